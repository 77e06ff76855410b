"""Schema migrations: `upgrade(url)` and the body of Alembic's env.py.

The migration scripts ship inside the package (`runbooks/store/migrations/`)
so that `runbook db upgrade` and the service's start-up work from an installed
wheel, where the repository's top-level `alembic/` does not exist. The
top-level `alembic.ini` + `alembic/env.py` are the developer entry point
(`alembic revision --autogenerate`, `alembic check`); they read the same
version scripts and run the same `run_migrations` below.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

from sqlalchemy.engine import make_url
from vllm_runbook.runbooks.store.database import (
    display_url,
    make_engine,
    resolve_url,
    translated_errors,
)
from vllm_runbook.runbooks.store.errors import SchemaMissing, StoreError, StoreUnavailable

MIGRATIONS_DIR: Final = Path(__file__).resolve().parent / "migrations"
VERSIONS_DIR: Final = MIGRATIONS_DIR / "versions"
# Any constant works; it only has to be the same for every replica.
_PG_MIGRATION_LOCK_ID: Final = 0x72756E626B  # "runbk"


def alembic_config(url: str | None = None) -> Any:
    """An Alembic Config pointing at the packaged migrations, no ini file needed."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("path_separator", "os")
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("version_locations", str(VERSIONS_DIR))
    # ConfigParser interpolation would eat a '%' in a password.
    config.set_main_option("sqlalchemy.url", resolve_url(url).replace("%", "%%"))
    return config


def upgrade(url: str | None = None, revision: str = "head") -> str | None:
    """Bring the database at `url` to `revision`; returns the revision now current.

    Safe to call on every service start and from several replicas at once: on
    PostgreSQL the migration runs under an advisory lock.
    """
    from alembic.runtime.migration import MigrationContext
    from alembic.util import CommandError

    from alembic import command

    resolved = resolve_url(url)
    with translated_errors(resolved):
        try:
            command.upgrade(alembic_config(resolved), revision)
        except CommandError as e:
            # e.g. the database was migrated by a newer release than this one.
            raise StoreError(f"cannot upgrade {display_url(resolved)}: {e}") from None
        engine = make_engine(resolved)
        try:
            with engine.connect() as connection:
                return MigrationContext.configure(connection).get_current_revision()
        finally:
            engine.dispose()


def current_revision(url: str | None = None) -> str | None:
    """The revision the database is at (None when never upgraded)."""
    from alembic.runtime.migration import MigrationContext

    resolved = resolve_url(url)
    engine = make_engine(resolved)
    try:
        with translated_errors(resolved), engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()


def _sqlite_file(url: str) -> Path | None:
    """The SQLite database file of `url` (None: not SQLite, or in memory)."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    return Path(parsed.database).expanduser()


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """An advisory lock on the database file itself (flock: SQLite's own
    POSIX locks are separate), so concurrent first uses migrate once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def ensure_schema(url: str | None = None) -> str:
    """Make the store ready for a command that writes; returns the resolved URL.

    A SQLite store (the embedded default, or any file named by --db or
    RUNBOOK_DB_URL) is created and migrated on first use, under a lock on its
    file so that several first uses at once migrate it once. Any other store
    that is behind raises SchemaMissing naming the command that upgrades it:
    shared databases are migrated on purpose, not by whichever CLI came first.
    """
    resolved = resolve_url(url)
    try:
        path = _sqlite_file(resolved)
    except Exception:  # an invalid URL: let the store's own error say so
        return resolved
    head = head_revision()
    if path is not None:
        try:
            lock = _exclusive(path)
            with lock:
                if current_revision(resolved) != head:
                    upgrade(resolved)
        except OSError as e:
            raise StoreUnavailable(f"store {display_url(resolved)} unavailable: {e}") from None
        return resolved
    if make_url(resolved).get_backend_name() == "sqlite":  # in memory: nothing persists
        upgrade(resolved)
        return resolved
    current = current_revision(resolved)
    if current != head:
        at = f"is at schema {current}" if current else "has no runbook schema"
        raise SchemaMissing(
            f"store {display_url(resolved)} {at}; this release needs {head}: "
            f"run `runbook db upgrade --db {display_url(resolved)}`"
        )
    return resolved


def has_journal(url: str | None = None) -> bool:
    """Whether the store holds a journal to read (False: no executions yet).
    Never creates anything: a missing SQLite file stays missing."""
    resolved = resolve_url(url)
    try:
        path = _sqlite_file(resolved)
    except Exception:
        return True  # let the store's own error speak
    if path is not None and (not path.exists() or path.stat().st_size == 0):
        return False
    try:
        return current_revision(resolved) is not None
    except StoreUnavailable:
        return True  # down: the read itself reports it


def head_revision() -> str | None:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


def _render_item(type_: str, obj: Any, autogen_context: Any) -> str | bool:
    # Migrations must not import application types: they would then break when
    # the type moves. UTCDateTime is a plain DATETIME in the database.
    from sqlalchemy import JSON
    from vllm_runbook.runbooks.store.models import UTCDateTime

    if type_ != "type":
        return False
    if isinstance(obj, UTCDateTime):
        return "sa.DateTime()"
    if isinstance(obj, JSON):
        # Every JSON column is JsonDocument; the default rendering of its
        # JSONB variant references an unimported Text().
        autogen_context.imports.add("from sqlalchemy.dialects import postgresql")
        return 'sa.JSON().with_variant(postgresql.JSONB(), "postgresql")'
    return False


def run_migrations(context: Any) -> None:
    """What env.py does, for both the packaged and the top-level alembic/ dir."""
    from vllm_runbook.runbooks.store.models import Base

    config = context.config
    url = resolve_url(config.get_main_option("sqlalchemy.url") or None)
    options: dict[str, Any] = {
        "target_metadata": Base.metadata,
        "render_item": _render_item,
        # SQLite cannot ALTER most things; batch mode copies the table there
        # and is a plain ALTER on PostgreSQL, so one script serves both.
        "render_as_batch": True,
        "compare_type": True,
    }
    if context.is_offline_mode():
        context.configure(url=url, literal_binds=True, **options)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            context.configure(connection=connection, **options)
            with context.begin_transaction():
                if connection.dialect.name == "postgresql":
                    # Replicas starting together: the second waits, then finds
                    # the schema at head and does nothing.
                    connection.exec_driver_sql(
                        f"SELECT pg_advisory_xact_lock({_PG_MIGRATION_LOCK_ID})"
                    )
                context.run_migrations()
    except StoreUnavailable:
        raise
    except Exception as e:
        if type(e).__module__.startswith(("sqlalchemy", "psycopg", "sqlite3")):
            with translated_errors(url):
                raise
        raise
    finally:
        engine.dispose()


__all__ = [
    "MIGRATIONS_DIR",
    "VERSIONS_DIR",
    "alembic_config",
    "current_revision",
    "display_url",
    "head_revision",
    "run_migrations",
    "upgrade",
]

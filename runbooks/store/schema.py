"""Schema migrations: `upgrade(url)` and the body of Alembic's env.py.

The migration scripts ship inside the package (`runbooks/store/migrations/`)
so that `runbook db upgrade` and the service's start-up work from an installed
wheel, where the repository's top-level `alembic/` does not exist. The
top-level `alembic.ini` + `alembic/env.py` are the developer entry point
(`alembic revision --autogenerate`, `alembic check`); they read the same
version scripts and run the same `run_migrations` below.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

from vllm_runbook.runbooks.store.database import (
    display_url,
    make_engine,
    resolve_url,
    translated_errors,
)
from vllm_runbook.runbooks.store.errors import StoreError, StoreUnavailable

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

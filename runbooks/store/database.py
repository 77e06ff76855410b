"""Where the store lives and how to connect to it.

One place decides the URL (explicit > `RUNBOOK_DB_URL` > a SQLite file in the
user's data directory), builds the SQLAlchemy engine with the settings each
dialect needs, and turns driver errors into the store's own exceptions.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

from sqlalchemy import Engine, create_engine, event, exc
from sqlalchemy.engine import URL, make_url
from vllm_runbook.runbooks.store.errors import SchemaMissing, StoreError, StoreUnavailable

ENV_VAR: Final = "RUNBOOK_DB_URL"
SQLITE_BUSY_TIMEOUT_MS: Final = 10_000
PG_CONNECT_TIMEOUT_S: Final = 5
# Execution option that makes a SQLite transaction start with BEGIN IMMEDIATE.
WRITE_OPTION: Final = "runbook_write"


def default_sqlite_path() -> Path:
    data_home = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data_home) / "vllm-runbook" / "runbook.db"


def resolve_url(url: str | None = None) -> str:
    """The database URL to use: explicit, else $RUNBOOK_DB_URL, else the default file."""
    if url:
        return normalize_url(url)
    from_env = os.environ.get(ENV_VAR)
    if from_env:
        return normalize_url(from_env)
    return f"sqlite:///{default_sqlite_path()}"


def normalize_url(url: str) -> str:
    """Pin PostgreSQL URLs to psycopg 3 (the driver we depend on, not psycopg2)."""
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def display_url(url: str | URL) -> str:
    """The URL with its password hidden, for messages and logs."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except exc.ArgumentError:
        return "<invalid database URL>"


def make_engine(url: str) -> Engine:
    """A SQLAlchemy engine configured for the store's access pattern.

    SQLite: WAL (readers never block the writer), a busy timeout (several
    processes share one file), foreign keys on, and write transactions that
    take the write lock up front (BEGIN IMMEDIATE) so two writers queue on
    the busy timeout instead of failing with SQLITE_BUSY mid-transaction.
    PostgreSQL: psycopg 3, a connect timeout, and pre-ping so a restarted
    server does not leave dead pooled connections behind.
    """
    try:
        parsed = make_url(normalize_url(url))
    except exc.ArgumentError as e:
        raise StoreUnavailable(f"invalid database URL: {e}") from None
    kwargs: dict[str, Any] = {}
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            try:
                Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise StoreUnavailable(f"cannot create the store's directory: {e}") from None
        kwargs["connect_args"] = {"check_same_thread": False}
    elif backend == "postgresql":
        kwargs["connect_args"] = {"connect_timeout": PG_CONNECT_TIMEOUT_S}
        kwargs["pool_pre_ping"] = True
    try:
        engine = create_engine(parsed, **kwargs)
    except (exc.ArgumentError, exc.NoSuchModuleError, ImportError) as e:
        raise StoreUnavailable(f"cannot use database URL {display_url(parsed)}: {e}") from None
    if backend == "sqlite":
        event.listen(engine, "connect", _sqlite_on_connect)
        event.listen(engine, "begin", _sqlite_on_begin)
    return engine


class SqliteFileGuard:
    """Whether the path of a SQLite store still names the file this process opened.

    A SQLite connection keeps its file open: delete or replace the file under a
    running service and its writes go on, into an inode that no later process
    will ever open, so deliveries answered 200 vanish at the next restart. The
    guard pins the file's (device, inode) at the first connection and `check`
    refuses once the path names another file or none; the store checks before
    every transaction and after every write's commit (a write answered after
    that check is in the file the path names). Nothing reopens the new file:
    what this process holds in memory (leases, the worker's runs) belongs to the
    old one, so it stays unavailable until restarted.

    SQLite does not delete the write-ahead log of a file that moved when its
    last connection closes, and the next process to open the path would replay
    it into whatever file is there now (a restored backup gets this process's
    pages). So once the file is gone, each connection is checkpointed with
    TRUNCATE as it closes (`_release`): the log's pages go into the old file
    and the log at the path is left empty.
    """

    def __init__(self, path: Path, url: str) -> None:
        self.path = path.absolute()  # SQLite opens relative paths from the cwd of now
        self.url = url
        self._identity: tuple[int, int] | None = None
        self._lock = threading.Lock()
        self.gone = False  # the path named another file, or none, at a check

    @classmethod
    def install(cls, engine: Engine, url: str) -> SqliteFileGuard | None:
        """A guard for `engine` when it is a SQLite file (None: PostgreSQL, memory)."""
        parsed = engine.url
        database = parsed.database
        if parsed.get_backend_name() != "sqlite" or database in (None, "", ":memory:"):
            return None
        if database.startswith("file:"):  # a SQLite URI: the path is not a file name
            return None
        guard = cls(Path(database), url)
        guard._identity = guard._stat()  # the file as it is now, if it exists yet
        event.listen(engine, "connect", guard._pin)
        event.listen(engine, "close", guard._release)
        return guard

    def _stat(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreUnavailable(
                f"store {display_url(self.url)} unavailable: {self.path}: {e.strerror}"
            ) from None
        return st.st_dev, st.st_ino

    def _pin(self, _dbapi_connection: Any, _record: Any) -> None:
        # The first connection creates a missing file: pin what it opened.
        with self._lock:
            if self._identity is None:
                self._identity = self._stat()

    def _release(self, dbapi_connection: Any, _record: Any) -> None:
        if not self.gone:
            return
        with contextlib.suppress(Exception):  # best effort: the connection is closing anyway
            dbapi_connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def check(self) -> None:
        """Raise StoreUnavailable when the path no longer names the pinned file."""
        if self._identity is None:
            return
        now = self._stat()
        if now == self._identity:
            return
        self.gone = True
        what = "removed" if now is None else "replaced by another file"
        raise StoreUnavailable(
            f"store {display_url(self.url)} unavailable: its file {self.path} was {what} "
            "after this process opened it; nothing more is written to the old file "
            "(restart to open the file now at that path)"
        )


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    # Hand transaction control to SQLAlchemy's "begin" event (the pysqlite
    # driver would otherwise issue its own deferred BEGIN).
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA journal_mode = WAL")
        cursor.execute("PRAGMA foreign_keys = ON")
    finally:
        cursor.close()


def _sqlite_on_begin(connection: Any) -> None:
    write = connection.get_execution_options().get(WRITE_OPTION, False)
    connection.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")


# SQLSTATEs meaning "the schema is not what the code expects".
_PG_SCHEMA_SQLSTATES: Final = {"42P01", "42703"}  # undefined_table, undefined_column
# A database that cannot take writes now (a read-only standby or transaction):
# unavailable, like SQLite's "attempt to write a readonly database".
_PG_UNAVAILABLE_SQLSTATES: Final = {"25006"}  # read_only_sql_transaction
_SQLITE_SCHEMA_MESSAGES: Final = ("no such table", "no such column", "has no column named")


def _first_line(error: BaseException) -> str:
    text = str(getattr(error, "orig", None) or error).strip()
    return text.splitlines()[0] if text else type(error).__name__


@contextmanager
def translated_errors(url: str) -> Iterator[None]:
    """Re-raise SQLAlchemy/driver errors as the store's exception tree."""
    try:
        yield
    except StoreError:
        raise
    except exc.DBAPIError as e:
        message = _first_line(e)
        sqlstate = getattr(e.orig, "sqlstate", None)
        if sqlstate in _PG_SCHEMA_SQLSTATES or any(m in message for m in _SQLITE_SCHEMA_MESSAGES):
            raise SchemaMissing(
                f"store {display_url(url)} has no up-to-date runbook schema "
                f"(run `runbook db upgrade`): {message}"
            ) from e
        if (
            isinstance(e, exc.OperationalError | exc.InterfaceError)
            or e.connection_invalidated
            or sqlstate in _PG_UNAVAILABLE_SQLSTATES
        ):
            raise StoreUnavailable(f"store {display_url(url)} unavailable: {message}") from e
        raise StoreError(f"store {display_url(url)}: {message}") from e
    except exc.TimeoutError as e:
        raise StoreUnavailable(f"store {display_url(url)} unavailable: {e}") from e
    except exc.SQLAlchemyError as e:
        raise StoreError(f"store {display_url(url)}: {_first_line(e)}") from e

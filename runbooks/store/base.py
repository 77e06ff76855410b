"""The store's plumbing: one database engine, transactions, the dialect's insert.

The tables' methods live beside it (executions.py, leases.py, incidents.py);
`Journal` (journal.py) is all of them over one engine.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, sessionmaker
from vllm_runbook.runbooks.store.database import (
    WRITE_OPTION,
    SqliteFileGuard,
    display_url,
    make_engine,
    resolve_url,
    translated_errors,
)
from vllm_runbook.runbooks.store.errors import StoreError, StoreUnavailable
from vllm_runbook.runbooks.store.events import install as install_events
from vllm_runbook.runbooks.store.models import Lease, utcnow


def iso(value: datetime | None) -> str | None:
    """A record's time in its JSON form."""
    return None if value is None else value.isoformat()


class StoreBase:
    """A database (SQLite file or PostgreSQL) and transactions on it."""

    def __init__(self, url: str | None = None, *, engine: Engine | None = None) -> None:
        self.url = resolve_url(url)
        self.engine = engine if engine is not None else make_engine(self.url)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._write_sessions = sessionmaker(
            self.engine.execution_options(**{WRITE_OPTION: True}), expire_on_commit=False
        )
        # Every transaction that changes an execution records its events (events.py).
        install_events(self._sessions)
        install_events(self._write_sessions)
        self._file_guard = SqliteFileGuard.install(self.engine, self.url)
        self._file_gone = False

    def __repr__(self) -> str:
        return f"Journal({display_url(self.url)!r})"

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def close(self) -> None:
        self.engine.dispose()

    @contextmanager
    def session(self, *, write: bool = False) -> Iterator[Session]:
        """A transaction: commits on success, rolls back on error.

        `write=True` takes SQLite's write lock at BEGIN so concurrent writers
        wait on the busy timeout rather than failing mid-transaction.
        Every transaction first checks that a SQLite store's file is still the
        one this process opened (SqliteFileGuard), and a write checks again
        after its commit: a caller that returns success (a webhook's 200) has
        its rows in the file a restart reads.
        """
        factory = self._write_sessions if write else self._sessions
        with translated_errors(self.url):
            self.check_file()
            with factory() as session, session.begin():
                yield session
            if write:
                self.check_file()

    def check_file(self) -> None:
        """StoreUnavailable when a SQLite store's file was removed or replaced.

        Then the pooled connections are closed at once: SQLite checkpoints the
        write-ahead log into the old file and deletes it, so that whoever opens
        the path next does not replay this process's log into the new file."""
        if self._file_guard is None:
            return
        try:
            self._file_guard.check()
        except StoreUnavailable:
            if not self._file_gone:
                self._file_gone = True
                self.engine.dispose()
            raise

    def probe_write(self) -> None:
        """Raise StoreError unless this store can write now: a write transaction
        inserts a row and rolls it back (the SQLite file is still the one opened
        and writable; PostgreSQL is reachable and not read-only)."""
        probe = f"probe:{socket.gethostname()}:{os.getpid()}"[:128]
        with translated_errors(self.url):
            self.check_file()
            with self._write_sessions() as session:
                session.add(Lease(name=probe, holder=probe, expires_at=utcnow()))
                session.flush()
                session.rollback()

    def _insert(self) -> Any:
        # ON CONFLICT DO NOTHING exists in both dialects we support; it makes
        # the duplicate-webhook path one statement with no exception to catch.
        if self.dialect == "postgresql":
            return postgresql.insert
        if self.dialect == "sqlite":
            return sqlite.insert
        raise StoreError(f"unsupported database dialect {self.dialect!r}")

"""Fixtures: a migrated SQLite file per test, and one PostgreSQL database per run.

Both are real databases. The PostgreSQL database gets a unique name per run
and is dropped afterwards; tests that use it carry the `service` marker.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from vllm_runbook.runbooks.store import Base, Journal, upgrade

PG_SERVER = os.environ.get("RUNBOOK_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432")
# Every table of the store (the models are the schema's single source).
TABLES = tuple(t.name for t in Base.metadata.sorted_tables)


def _admin_engine():  # type: ignore[no-untyped-def]
    return create_engine(f"{PG_SERVER}/test", isolation_level="AUTOCOMMIT")


@pytest.fixture(scope="session")
def pg_database() -> Iterator[str]:
    """A fresh, empty PostgreSQL database for this test run (dropped after)."""
    name = f"runbook_test_{uuid.uuid4().hex[:12]}"
    admin = _admin_engine()
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield f"{PG_SERVER}/{name}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def fresh_pg_database() -> Iterator[str]:
    """An empty PostgreSQL database of its own (for migration tests)."""
    name = f"runbook_test_{uuid.uuid4().hex[:12]}"
    admin = _admin_engine()
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield f"{PG_SERVER}/{name}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(scope="session")
def pg_migrated(pg_database: str) -> str:
    upgrade(pg_database)
    return pg_database


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A migrated SQLite file, copied per test (running Alembic each time is slow)."""
    path = tmp_path_factory.mktemp("template") / "runbook.db"
    upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture
def sqlite_url(sqlite_template: Path, tmp_path: Path) -> str:
    target = tmp_path / "runbook.db"
    shutil.copy(sqlite_template, target)
    return f"sqlite:///{target}"


@pytest.fixture
def pg_url(pg_migrated: str) -> str:
    engine = create_engine(pg_migrated)
    with engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {', '.join(TABLES)} RESTART IDENTITY CASCADE"))
    engine.dispose()
    return pg_migrated


@pytest.fixture(
    params=["sqlite", pytest.param("postgresql", marks=pytest.mark.service)],
)
def db_url(request: pytest.FixtureRequest) -> str:
    """Each test that takes it runs on SQLite and on PostgreSQL."""
    fixture = "sqlite_url" if request.param == "sqlite" else "pg_url"
    return str(request.getfixturevalue(fixture))


@pytest.fixture
def store(db_url: str) -> Iterator[Journal]:
    s = Journal(db_url)
    try:
        yield s
    finally:
        s.close()

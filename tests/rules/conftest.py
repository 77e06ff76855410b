"""Real databases for the rules engine's incident tests: a migrated SQLite file per
test, and one PostgreSQL database per run (uniquely named, dropped afterwards)."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from vllm_runbook.runbooks.store import Journal, upgrade

PG_SERVER = os.environ.get("RUNBOOK_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432")


@pytest.fixture(scope="session")
def rules_pg_database() -> Iterator[str]:
    name = f"runbook_rules_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(f"{PG_SERVER}/postgres", isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        url = f"{PG_SERVER}/{name}"
        upgrade(url)
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(scope="session")
def rules_sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rules-db") / "runbook.db"
    upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.service)])
def incident_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Journal]:
    """A migrated, empty store: SQLite, then PostgreSQL."""
    if request.param == "sqlite":
        target = tmp_path / "runbook.db"
        shutil.copy(request.getfixturevalue("rules_sqlite_template"), target)
        url = f"sqlite:///{target}"
    else:
        url = request.getfixturevalue("rules_pg_database")
        engine = create_engine(url)
        with engine.begin() as conn:
            conn.execute(text("TRUNCATE incidents RESTART IDENTITY"))
        engine.dispose()
    store = Journal(url)
    try:
        yield store
    finally:
        store.close()

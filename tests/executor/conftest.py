"""Fixtures for the executor tests: a migrated SQLite journal per test, and
the `runbook` CLI of this checkout in a subprocess (foreground or background)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from vllm_runbook.runbooks.store import Journal, upgrade


@pytest.fixture(scope="session")
def exec_db_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("exec-db") / "runbook.db"
    upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture
def db_url(exec_db_template: Path, tmp_path: Path) -> str:
    """A fresh, migrated journal for this test (copied: Alembic per test is slow)."""
    target = tmp_path / "runbook.db"
    shutil.copy(exec_db_template, target)
    return f"sqlite:///{target}"


@pytest.fixture
def store(db_url: str) -> Any:
    s = Journal(db_url)
    yield s
    s.close()

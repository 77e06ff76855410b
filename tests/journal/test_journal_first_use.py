"""First use: the on-call's first command works on a machine with no journal yet."""

from __future__ import annotations

import concurrent.futures
import json
from pathlib import Path

import pytest
from vllm_runbook.runbooks.store import Journal, current_revision, head_revision, upgrade

from tests.engines import free_port, runbook_cli


def _down_engine() -> str:
    return f"http://127.0.0.1:{free_port()}"


def test_exec_creates_and_migrates_the_default_journal(tmp_path: Path) -> None:
    home = tmp_path / "data"
    env = {"XDG_DATA_HOME": str(home), "RUNBOOK_DB_URL": ""}
    done = runbook_cli("exec", "oom-pressure", "--engine", _down_engine(), "--yes", env=env)
    # The engine is down (3), not the store (4): the journal was made on first use.
    assert done.returncode == 3, done.stderr
    assert "unreachable" in done.stderr and "db upgrade" not in done.stderr
    path = home / "vllm-runbook" / "runbook.db"
    assert current_revision(f"sqlite:///{path}") == head_revision()
    store = Journal(f"sqlite:///{path}")
    (record,) = store.list_executions()
    store.close()
    assert (record.runbook, record.status) == ("oom-pressure", "failed")


def test_an_empty_sqlite_file_named_by_db_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / "empty.db"
    path.touch()  # what the old first use left behind
    done = runbook_cli(
        "exec", "oom-pressure", "--engine", _down_engine(), "--db", f"sqlite:///{path}"
    )
    assert done.returncode == 3, done.stderr
    assert current_revision(f"sqlite:///{path}") == head_revision()


def test_concurrent_first_uses_migrate_once(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    # Four engines (one engine's lock would refuse the others: exit 2).
    engines = [_down_engine() for _ in range(4)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        runs = list(
            pool.map(
                lambda e: runbook_cli("exec", "latency-spike", "--engine", e, "--db", url),
                engines,
            )
        )
    assert [r.returncode for r in runs] == [3, 3, 3, 3], [r.stderr for r in runs]
    store = Journal(url)
    records = store.list_executions()
    store.close()
    assert len(records) == 4


def test_read_only_commands_on_a_missing_store_say_no_executions_yet(tmp_path: Path) -> None:
    path = tmp_path / "never.db"
    url = f"sqlite:///{path}"
    done = runbook_cli("history", "--db", url)
    assert (done.returncode, done.stdout, done.stderr) == (0, "no executions yet\n", "")
    done = runbook_cli("history", "--db", url, "--json")
    assert (done.returncode, json.loads(done.stdout)) == (0, {"executions": []})
    done = runbook_cli("history", "3", "--db", url)
    assert (done.returncode, done.stderr) == (
        2,
        "runbook: error: no executions yet (no execution with id 3)\n",
    )
    done = runbook_cli("report", "3", "--db", url)
    assert (done.returncode, done.stderr) == (
        2,
        "runbook: error: no executions yet (no execution with id 3)\n",
    )
    assert not path.exists()  # reading created nothing


def test_a_postgresql_store_behind_says_what_to_run(fresh_pg_database: str) -> None:
    done = runbook_cli(
        "exec", "oom-pressure", "--engine", _down_engine(), "--db", fresh_pg_database
    )
    assert done.returncode == 4
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert "has no runbook schema; this release needs " in done.stderr
    assert "run `runbook db upgrade --db postgresql+psycopg://" in done.stderr
    assert current_revision(fresh_pg_database) is None  # nothing migrated behind its back


def test_pending_and_answers_on_a_missing_journal_say_nothing_is_there(tmp_path: Path) -> None:
    # A fresh machine: no journal in the default place yet.
    home = tmp_path / "data"
    env = {"XDG_DATA_HOME": str(home), "RUNBOOK_DB_URL": ""}
    done = runbook_cli("pending", env=env)
    assert (done.returncode, done.stdout, done.stderr) == (
        0,
        "no executions awaiting approval (no journal yet)\n",
        "",
    )
    done = runbook_cli("pending", "--json", env=env)
    assert (done.returncode, json.loads(done.stdout), done.stderr) == (0, {"pending": []}, "")
    for verb in ("approve", "reject"):
        done = runbook_cli(verb, "3", env=env)
        assert (done.returncode, done.stdout, done.stderr) == (
            2,
            "",
            "runbook: error: no executions yet (no execution with id 3)\n",
        )
    done = runbook_cli("history", env=env)
    assert (done.returncode, done.stdout, done.stderr) == (0, "no executions yet\n", "")
    assert not (home / "vllm-runbook" / "runbook.db").exists()  # reading created nothing


@pytest.mark.service
def test_pending_on_a_postgresql_database_without_a_journal(fresh_pg_database: str) -> None:
    done = runbook_cli("pending", "--db", fresh_pg_database)
    assert (done.returncode, done.stdout, done.stderr) == (
        0,
        "no executions awaiting approval (no journal yet)\n",
        "",
    )
    assert current_revision(fresh_pg_database) is None


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgresql", marks=pytest.mark.service)]
)
def test_read_commands_on_a_journal_behind_say_to_upgrade(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url = (
        f"sqlite:///{tmp_path / 'old.db'}"
        if backend == "sqlite"
        else str(request.getfixturevalue("fresh_pg_database"))
    )
    upgrade(url, "0001")  # a journal written by an older release
    for command in (["pending"], ["history"], ["approve", "1"]):
        done = runbook_cli(*command, "--db", url)
        assert done.returncode == 4, (command, done.stdout, done.stderr)
        assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
        assert "has no up-to-date runbook schema (run `runbook db upgrade`)" in done.stderr

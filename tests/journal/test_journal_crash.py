"""SIGKILL mid-execution, then read the journal back (API and CLI)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_runbook.runbooks.store import Journal

ROOT = Path(__file__).resolve().parents[2]


def run_until(url: str, point: str) -> int:
    """Start the crash worker, wait until it reaches `point`, SIGKILL it."""
    env = dict(os.environ)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.journal.crash_worker", url, point],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        assert line[:2] == ["at", point], line
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=10)  # reaped: the pid is really gone
    assert proc.returncode == -signal.SIGKILL
    return int(line[2])


def cli_history(url: str) -> dict[str, object]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_runbook.runbooks.operate.cli",
            "history",
            "--db",
            url,
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ),
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    (execution,) = json.loads(out.stdout)["executions"]
    return execution


def test_sigkill_while_applying_leaves_a_truthful_revertible_journal(sqlite_url: str) -> None:
    execution_id = run_until(sqlite_url, "applying")
    store = Journal(sqlite_url)

    record = store.get_execution(execution_id)
    assert (record.status, record.interrupted, record.display_status) == (
        "running",
        True,
        "interrupted",
    )
    (step,) = record.steps
    assert (step.status, step.before, step.after) == (
        "applying",
        {"max_num_batched_tokens": 512},
        None,
    )
    # A fresh process (the CLI) tells the same story.
    shown = cli_history(sqlite_url)
    assert (shown["id"], shown["status"], shown["display_status"]) == (
        execution_id,
        "running",
        "interrupted",
    )
    assert store.engines_under_remediation() == {"llama-0"}

    assert store.recover_interrupted() == [execution_id]
    assert store.recover_interrupted() == []  # idempotent
    record = store.get_execution(execution_id)
    assert (record.status, record.error, record.interrupted) == ("failed", "interrupted", False)
    (step,) = record.steps
    assert step.status == "interrupted"
    assert step.before == {"max_num_batched_tokens": 512}  # enough to revert
    assert store.engines_under_remediation() == set()
    # The revert path is open: failed → reverted, the step marked reverted.
    store.finish_step(step.id, "reverted")
    assert store.transition(execution_id, "reverted").status == "reverted"
    store.close()


@pytest.mark.parametrize(
    ("point", "status", "step_statuses"),
    [
        ("created", "pending", []),
        ("running", "running", []),
        ("applied", "running", ["applied"]),
        ("verifying", "verifying", ["applied"]),
    ],
)
def test_sigkill_at_any_point_is_reported_interrupted(
    sqlite_url: str, point: str, status: str, step_statuses: list[str]
) -> None:
    execution_id = run_until(sqlite_url, point)
    store = Journal(sqlite_url)
    record = store.get_execution(execution_id)
    assert (record.status, record.display_status) == (status, "interrupted")
    assert [s.status for s in record.steps] == step_statuses
    assert store.recover_interrupted() == [execution_id]
    record = store.get_execution(execution_id)
    assert (record.status, record.error) == ("failed", "interrupted")
    assert [s.status for s in record.steps] == step_statuses  # applied stays applied
    store.close()


@pytest.mark.service
def test_sigkill_on_postgres(pg_url: str) -> None:
    execution_id = run_until(pg_url, "applying")
    store = Journal(pg_url)
    assert store.get_execution(execution_id).display_status == "interrupted"
    assert store.recover_interrupted() == [execution_id]
    assert [s.status for s in store.get_execution(execution_id).steps] == ["interrupted"]
    store.close()


def test_live_execution_is_not_interrupted(sqlite_url: str) -> None:
    store = Journal(sqlite_url)
    record, _ = store.create_execution("warmup", "e", trigger="cli", who="me")
    store.transition(record.id, "running")
    assert store.get_execution(record.id).interrupted is False
    assert store.recover_interrupted() == []
    store.close()


CREATE_AND_DIE = """
import sys
from datetime import UTC, datetime
from vllm_runbook.runbooks.store import Journal
record, _ = Journal(sys.argv[1]).create_execution(
    "oom-pressure", "llama-0", trigger="alert", who="alertmanager:VllmOOMPressure",
    alert_fingerprint="fp-1", alert_starts_at=datetime.now(UTC), reason=sys.argv[2] or None,
)
print(record.id)
"""


@pytest.mark.parametrize("reason", ["awaiting approval", ""])
def test_a_pending_alert_execution_outlives_the_replica_that_recorded_it(
    db_url: str, reason: str
) -> None:
    """The replica that took the webhook names itself in the row, but any
    worker runs the execution: that replica's death (killed, restarted)
    interrupts nothing. It used to be settled `failed: interrupted` by the next
    run on the host, so an execution awaiting approval never ran."""
    out = subprocess.run(
        [sys.executable, "-c", CREATE_AND_DIE, db_url, reason],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=True,
    )
    execution_id = int(out.stdout)
    store = Journal(db_url)
    record = store.get_execution(execution_id)
    assert (record.status, record.interrupted, record.display_status) == (
        "pending",
        False,
        "pending",
    )
    assert store.recover_interrupted() == []
    assert store.get_execution(execution_id).status == "pending"
    assert [r.id for r in store.runnable_executions()] == ([] if reason else [execution_id])
    store.close()

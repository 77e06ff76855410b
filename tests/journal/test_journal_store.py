"""The Journal API against real SQLite and PostgreSQL databases."""

from __future__ import annotations

import os
import socket
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from vllm_runbook.runbooks.store import (
    EXECUTION_STATUSES,
    EXECUTION_TRANSITIONS,
    ExecutionNotFound,
    ExecutionStatus,
    IllegalTransition,
    Incident,
    Journal,
    NewExecution,
    SchemaMissing,
    StoreError,
    StoreUnavailable,
    process_start,
    resolve_url,
)
from vllm_runbook.runbooks.store.models import ApprovalState, Execution, ExecutionEvent

STARTS = datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=UTC)


def alert_run(store: Journal, fingerprint: str = "fp1", starts_at: datetime = STARTS):
    return store.create_execution(
        "oom-pressure",
        "llama-0",
        trigger="alert",
        who="alertmanager",
        alert_fingerprint=fingerprint,
        alert_starts_at=starts_at,
    )


def cli_run(store: Journal, runbook: str = "oom-pressure", engine: str = "llama-0", **kw):
    record, created = store.create_execution(runbook, engine, trigger="cli", who="alice", **kw)
    assert created is True
    return record


def test_create_cli_execution_records_runner(store: Journal) -> None:
    record = cli_run(store, reason="on-call")
    assert (record.id, record.status, record.trigger, record.who) == (1, "pending", "cli", "alice")
    assert (record.pid, record.hostname) == (os.getpid(), socket.gethostname())
    assert record.created_at.tzinfo is UTC
    assert record.started_at is None and record.finished_at is None
    assert record.interrupted is False and record.display_status == "pending"
    # CLI runs carry no episode: any number of them may exist.
    assert cli_run(store).id == 2


def test_alert_episode_is_unique(store: Journal) -> None:
    first, created = alert_run(store)
    assert created is True
    again, created_again = alert_run(store)
    assert (again.id, created_again) == (first.id, False)
    # Same instant expressed in another zone is the same episode.
    other_zone = STARTS.astimezone(datetime.now().astimezone().tzinfo)
    assert alert_run(store, starts_at=other_zone) == (again, False)
    # A new episode (new startsAt or fingerprint) is a new execution.
    assert alert_run(store, starts_at=STARTS + timedelta(seconds=1))[1] is True
    assert alert_run(store, fingerprint="fp2")[1] is True
    assert len(store.list_executions()) == 3
    assert store.get_execution(first.id).alert_starts_at == STARTS


def test_alert_run_needs_its_episode(store: Journal) -> None:
    with pytest.raises(ValueError, match="fingerprint and startsAt"):
        store.create_execution("oom-pressure", "e", trigger="alert", who="am")
    with pytest.raises(ValueError, match="trigger 'cron'"):
        store.create_execution("oom-pressure", "e", trigger="cron", who="am")


def test_create_executions_in_bulk(store: Journal) -> None:
    """The one creation path: many at once, in the caller's transaction, each
    alert episode once (already stored, or repeated in the list)."""
    first, _ = alert_run(store)  # an earlier delivery

    def alert(fingerprint: str, reason: str | None = None) -> NewExecution:
        return NewExecution(
            "oom-pressure",
            "llama-0",
            trigger="alert",
            who="alertmanager",
            alert_fingerprint=fingerprint,
            alert_starts_at=STARTS,
            reason=reason,
        )

    new = [
        alert("fp1"),  # stored before
        alert("fp2", ApprovalState.AWAITING),
        NewExecution("oom-pressure", "llama-0", trigger="cli", who="alice"),
        alert("fp2"),  # a repeat in the same list
        *(alert(f"bulk-{i}") for i in range(300)),
    ]
    with store.session(write=True) as s:
        made = store.create_executions(s, new)
    assert made[0] == (first.id, False)
    assert made[1][1] is True and made[3] == (made[1][0], False)
    assert made[2][1] is True
    assert all(created for _, created in made[4:])
    assert len({i for i, _ in made}) == len(new) - 1
    assert len(store.list_executions(limit=1000)) == 303
    waiting = store.get_execution(made[1][0])
    assert (waiting.status, waiting.reason) == (ExecutionStatus.PENDING, "awaiting approval")
    assert waiting.awaiting_approval and [r.id for r in store.pending_approvals()] == [waiting.id]
    with store.session() as s:
        rows = s.query(Execution.pid, Execution.pid_start, Execution.hostname).all()
        events = s.query(ExecutionEvent.execution_id, ExecutionEvent.event).all()
    # Filled as on the single path: this process, its start time, this host.
    assert set(rows) == {(os.getpid(), process_start(os.getpid()), socket.gethostname())}
    # The events commit with the executions (only the one awaiting a person has one).
    assert events == [(waiting.id, "awaiting approval")]
    with store.session(write=True) as s:
        assert store.create_executions(s, []) == []


def test_concurrent_duplicate_deliveries_create_one_execution(db_url: str) -> None:
    # Two "replicas" (separate engines and pools), 20 deliveries at once.
    replicas = [Journal(db_url), Journal(db_url)]
    try:
        with ThreadPoolExecutor(max_workers=8) as pool:
            results = list(pool.map(lambda i: alert_run(replicas[i % 2]), range(20)))
        assert sum(created for _, created in results) == 1
        # One row; on PostgreSQL a losing INSERT .. ON CONFLICT still takes a sequence value.
        assert len({record.id for record, _ in results}) == 1
        assert len(replicas[0].list_executions()) == 1
    finally:
        for replica in replicas:
            replica.close()


def test_lifecycle_timestamps_and_errors(store: Journal) -> None:
    record = cli_run(store)
    running = store.transition(record.id, "running")
    assert running.status == "running" and running.started_at is not None
    assert running.finished_at is None
    verifying = store.transition(record.id, "verifying")
    assert verifying.started_at == running.started_at
    done = store.transition(record.id, "failed", error="preemptions rose 12 → 30")
    assert (done.status, done.error) == ("failed", "preemptions rose 12 → 30")
    assert done.finished_at is not None and done.finished_at >= done.started_at
    assert store.transition(record.id, "reverted").status == "reverted"
    with pytest.raises(IllegalTransition, match="cannot go from 'reverted' to 'running'"):
        store.transition(record.id, "running")
    with pytest.raises(ExecutionNotFound, match="no execution with id 99"):
        store.transition(99, "running")
    with pytest.raises(ValueError, match="status 'done'"):
        store.transition(record.id, "done")


def _path_to(status: str) -> list[str]:
    """The shortest legal path from pending to `status` (BFS over the table)."""
    paths = {"pending": ["pending"]}
    frontier = ["pending"]
    while frontier:
        current = frontier.pop(0)
        for nxt in sorted(EXECUTION_TRANSITIONS[current]):
            if nxt not in paths:
                paths[nxt] = [*paths[current], nxt]
                frontier.append(nxt)
    return paths[status]


def test_every_transition_pair_follows_the_table(sqlite_url: str) -> None:
    store = Journal(sqlite_url)
    accepted = set()
    for current in EXECUTION_STATUSES:
        for requested in EXECUTION_STATUSES:
            record = cli_run(store)
            for status in _path_to(current)[1:]:
                store.transition(record.id, status)
            try:
                store.transition(record.id, requested)
            except IllegalTransition:
                assert store.get_execution(record.id).status == current
            else:
                accepted.add((current, requested))
    expected = {(a, b) for a, targets in EXECUTION_TRANSITIONS.items() for b in targets}
    assert accepted == expected
    store.close()


def test_steps_record_before_and_after(store: Journal) -> None:
    record = cli_run(store)
    store.transition(record.id, "running")
    step = store.add_step(
        record.id,
        "scale_max_num_batched_tokens",
        {"factor": 0.5},
        before={"max_num_batched_tokens": 512},
    )
    assert (step.ordinal, step.status, step.before, step.after) == (
        1,
        "applying",
        {"max_num_batched_tokens": 512},
        None,
    )
    applied = store.finish_step(
        step.id, "applied", after={"max_num_batched_tokens": 256}, applied_at_step=1234
    )
    assert (applied.status, applied.after, applied.applied_at_step) == (
        "applied",
        {"max_num_batched_tokens": 256},
        1234,
    )
    assert applied.finished_at is not None
    second = store.add_step(record.id, "set_max_num_seqs", {"value": "kv_capacity"})
    failed = store.finish_step(second.id, "failed", error="engine unreachable")
    assert (failed.ordinal, failed.status, failed.error) == (2, "failed", "engine unreachable")
    with pytest.raises(StoreError, match="cannot go from 'failed' to 'applied'"):
        store.finish_step(second.id, "applied")
    store.transition(record.id, "rolled_back")
    with pytest.raises(StoreError, match="is rolled_back: no more steps"):
        store.add_step(record.id, "advise", {"text": "x"})
    got = store.get_execution(record.id)
    assert [(s.ordinal, s.action, s.status) for s in got.steps] == [
        (1, "scale_max_num_batched_tokens", "applied"),
        (2, "set_max_num_seqs", "failed"),
    ]
    assert got.to_dict()["steps"][0]["params"] == {"factor": 0.5}


def test_dry_run_steps_are_planned(store: Journal) -> None:
    record = cli_run(store, dry_run=True)
    store.transition(record.id, "running")
    step = store.add_step(
        record.id,
        "set_policy",
        {"policy": "fcfs"},
        before={"policy": "priority"},
        after={"policy": "fcfs"},
        status="planned",
    )
    assert step.status == "planned" and step.finished_at is not None
    with pytest.raises(ValueError, match="a step starts as one of"):
        store.add_step(record.id, "set_policy", status="applied")


def test_checks_and_verification_round_trip(store: Journal) -> None:
    record = cli_run(store)
    checks = {"kv_cache_usage": {"value": 0.97, "description": "KV usage"}}
    verification = {"signal": "preemptions_per_minute", "before": 37.0, "after": 0.0}
    store.record_checks(record.id, checks)
    store.record_verification(record.id, verification)
    got = store.get_execution(record.id)
    assert (got.checks, got.verification) == (checks, verification)


def test_guardrail_queries_count_real_runs_only(store: Journal) -> None:
    assert store.last_run_started("oom-pressure", "llama-0") is None
    real = cli_run(store)
    started = store.transition(real.id, "running").started_at
    store.transition(real.id, "succeeded")
    dry = cli_run(store, dry_run=True)
    store.transition(dry.id, "running")
    refused = cli_run(store)
    store.transition(refused.id, "refused", reason="cooldown: 290 s left")
    cli_run(store)  # pending, never started
    other = cli_run(store, engine="llama-1")
    store.transition(other.id, "running")
    # A revert restores: it neither extends the cooldown nor counts as a run.
    revert = cli_run(store, reverts_id=real.id)
    store.transition(revert.id, "running")
    assert store.last_run_started("oom-pressure", "llama-0") == started
    assert store.last_run_started("latency-spike", "llama-0") is None
    hour_ago = datetime.now(UTC) - timedelta(hours=1)
    assert store.runs_started_since("oom-pressure", "llama-0", hour_ago) == [started]
    assert store.runs_started_since("oom-pressure", "llama-0", datetime.now(UTC)) == []
    assert store.runs_started_since("latency-spike", "llama-0", hour_ago) == []
    with pytest.raises(ValueError, match="timezone-aware"):
        store.runs_started_since("oom-pressure", "llama-0", datetime(2026, 1, 1))
    # Running or verifying, real, not a revert: llama-1's run. The revert on
    # llama-0, the dry run and the pending run do not count.
    assert store.engines_under_remediation() == {"llama-1"}
    assert store.engines_under_remediation(other_than="llama-1") == set()
    again = cli_run(store)
    store.transition(again.id, "running")
    store.transition(again.id, "verifying")
    assert store.engines_under_remediation() == {"llama-0", "llama-1"}
    assert store.engines_under_remediation(other_than="llama-0") == {"llama-1"}
    assert store.runs_started_since("oom-pressure", "llama-0", hour_ago) == [
        started,
        store.get_execution(again.id).started_at,
    ]


def test_find_episode(store: Journal) -> None:
    first, _ = alert_run(store)
    found = store.find_episode("oom-pressure", "llama-0", "fp1", STARTS)
    assert found is not None and found.id == first.id
    assert store.find_episode("oom-pressure", "llama-0", "fp2", STARTS) is None
    assert store.find_episode("oom-pressure", "llama-1", "fp1", STARTS) is None


def test_list_filters_and_order(store: Journal) -> None:
    for engine in ("a", "b", "a"):
        cli_run(store, engine=engine)
    assert [r.id for r in store.list_executions()] == [3, 2, 1]
    assert [r.id for r in store.list_executions("a")] == [3, 1]
    assert [r.id for r in store.list_executions(limit=1)] == [3]
    assert store.list_executions(runbook="warmup") == []


def test_leases(store: Journal) -> None:
    assert store.acquire_lease("rules", "replica-a", ttl_seconds=30) is True
    assert store.acquire_lease("rules", "replica-b", ttl_seconds=30) is False
    assert store.lease_holder("rules") == "replica-a"
    assert store.renew_lease("rules", "replica-a", ttl_seconds=30) is True
    assert store.renew_lease("rules", "replica-b", ttl_seconds=30) is False
    assert store.release_lease("rules", "replica-a") is True
    assert store.lease_holder("rules") is None
    assert store.acquire_lease("rules", "replica-b", ttl_seconds=0.01) is True
    assert store.renew_lease("rules", "replica-a", ttl_seconds=30) is False
    # An expired lease is free for anyone, and its old holder cannot renew it.
    import time

    time.sleep(0.02)
    assert store.renew_lease("rules", "replica-b", ttl_seconds=30) is False
    assert store.acquire_lease("rules", "replica-a", ttl_seconds=30) is True
    assert store.lease_holder("rules") == "replica-a"


def test_one_open_incident_per_alert_and_engine(store: Journal) -> None:
    with store.session(write=True) as s:
        s.add(Incident(alert="VllmOOMPressure", engine="e", severity="critical", state="firing"))
    with pytest.raises(StoreError, match="open_key"), store.session(write=True) as s:
        s.add(Incident(alert="VllmOOMPressure", engine="e", severity="critical", state="pending"))
    with store.session(write=True) as s:
        incident = s.query(Incident).one()
        incident.state = "resolved"
        incident.resolved_at = datetime.now(UTC)
    with store.session(write=True) as s:
        s.add(Incident(alert="VllmOOMPressure", engine="e", severity="critical", state="firing"))
    with store.session() as s:
        states = sorted((i.state, i.open_key is None) for i in s.query(Incident))
    assert states == [("firing", False), ("resolved", True)]


def test_down_postgres_raises_store_unavailable() -> None:
    # Port 1 on loopback: connection refused at once.
    store = Journal("postgresql://postgres@127.0.0.1:1/runbook")
    with pytest.raises(StoreUnavailable, match=r"^store postgresql\+psycopg://postgres@127"):
        store.list_executions()
    with pytest.raises(StoreUnavailable):
        store.create_execution("oom-pressure", "e", trigger="cli", who="x")


def test_unopenable_sqlite_raises_store_unavailable(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(StoreUnavailable, match="cannot create the store's directory"):
        Journal(f"sqlite:///{blocker}/sub/runbook.db")
    with pytest.raises(StoreUnavailable, match="invalid database URL"):
        Journal("not a url")


def test_password_is_hidden_in_errors() -> None:
    store = Journal("postgresql://u:s3cret@127.0.0.1:1/runbook")
    with pytest.raises(StoreUnavailable) as info:
        store.list_executions()
    assert "s3cret" not in str(info.value) and "***" in str(info.value)


def test_unmigrated_database_raises_schema_missing(tmp_path: Path) -> None:
    store = Journal(f"sqlite:///{tmp_path}/empty.db")
    with pytest.raises(SchemaMissing, match="run `runbook db upgrade`"):
        store.list_executions()


@pytest.mark.service
def test_unmigrated_postgres_raises_schema_missing(fresh_pg_database: str) -> None:
    store = Journal(fresh_pg_database)
    with pytest.raises(SchemaMissing, match="run `runbook db upgrade`"):
        store.get_execution(1)
    store.close()


def test_url_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("RUNBOOK_DB_URL", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert resolve_url() == f"sqlite:///{tmp_path}/vllm-runbook/runbook.db"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert resolve_url() == f"sqlite:///{tmp_path}/home/.local/share/vllm-runbook/runbook.db"
    monkeypatch.setenv("RUNBOOK_DB_URL", "postgres://u@h/db")
    assert resolve_url() == "postgresql+psycopg://u@h/db"
    assert resolve_url("sqlite:///x.db") == "sqlite:///x.db"

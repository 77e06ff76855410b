"""A busy day's journal: one delivery of hundreds of alerts, executions that
wait for a person by the hundred. Every event of every execution is still
notified, and an approved execution runs however old it is; on SQLite and
PostgreSQL, through the webhook, the notifier's jobs and the worker."""

from __future__ import annotations

import copy
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from vllm_runbook.runbooks.service.app import Credentials
from vllm_runbook.runbooks.service.notify import Notifier, Receiver
from vllm_runbook.runbooks.store.models import ExecutionStatus

from tests.fake_agent import FakeAgent
from tests.service.conftest import Schedule
from tests.service.test_service_approvals import CONFIG, Replica
from tests.service.test_service_notify import Hooks
from tests.service.test_service_webhooks import AUTH, TOKEN, payload


def many(n: int, first: int = 0) -> dict[str, Any]:
    """One delivery of `n` firing VllmOOMPressure alerts (distinct episodes):
    one commit, so every execution it creates has the same timestamps."""
    body = payload()
    [alert] = body["alerts"]
    body["alerts"] = []
    for i in range(first, first + n):
        one = copy.deepcopy(alert)
        one["fingerprint"] = f"busy-{i:05d}"
        body["alerts"].append(one)
    return body


@pytest.fixture
def replica(db_url: str, tmp_path: Path) -> Iterator[Replica]:
    cfg = tmp_path / "runbook.yaml"
    cfg.write_text(CONFIG)  # oom-pressure: approve
    r = Replica(db_url, cfg, FakeAgent.kv_bound(), Credentials(token=TOKEN))
    with r.client:
        yield r
    r.store.close()


@pytest.fixture
def hooks() -> Iterator[Hooks]:
    h = Hooks()
    yield h
    h.close()


def deliver(r: Replica, body: dict[str, Any]) -> list[dict[str, Any]]:
    response = r.client.post("/webhooks/alertmanager", json=body, headers=AUTH)
    assert response.status_code == 200, response.text
    return list(response.json()["executions"])


def wait_until(condition: Callable[[], bool], limit: float) -> bool:
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_one_large_delivery_is_notified_whole_and_the_feed_goes_on(
    replica: Replica, hooks: Hooks, scheduled: Schedule
) -> None:
    """450 executions with one updated_at (the old feed re-read the same 200
    at every poll and never got further), then a later delivery."""
    notifier = Notifier(
        replica.store,
        [Receiver("ops", "webhook", hooks.url + "/ok")],
        retries=0,
        timeout_s=5.0,
        interval_s=0.05,
    )
    scheduled(notifier)
    try:
        created = deliver(replica, many(450))
        assert len({e["id"] for e in created}) == 450
        got = lambda: len(hooks.bodies.get("/ok", []))  # noqa: E731
        wait_until(lambda: got() >= 450, 60)
        later = deliver(replica, many(1, first=450))
        wait_until(lambda: got() >= 451, 30)
        time.sleep(0.5)  # a duplicate would arrive now
    finally:
        notifier.stop()
    bodies = hooks.bodies["/ok"]
    sent = Counter((b["execution_id"], b["event"]) for b in bodies)
    expected = {(e["id"], "awaiting approval") for e in created + later}
    assert set(sent) == expected
    assert set(sent.values()) == {1}  # each once
    assert len(bodies) == 451


def test_an_approved_execution_older_than_the_newest_200_runs(replica: Replica) -> None:
    """The worker used to scan the newest 200 executions only."""
    created = deliver(replica, many(250))
    oldest = min(e["id"] for e in created)
    assert replica.worker.tick() == 0  # all await a person
    approve = f"/api/executions/{oldest}/approve"
    assert replica.client.post(approve, json={"note": "go"}, headers=AUTH).status_code == 200
    assert replica.worker.tick() == 1
    done = replica.store.get_execution(oldest)
    assert (done.status, done.decided_by, done.decision_note) == (
        ExecutionStatus.SUCCEEDED,
        "webhook token",
        "go",
    )
    assert replica.worker.tick() == 0  # once
    assert len(replica.store.pending_approvals()) == 249


def test_an_approval_wakes_the_worker(replica: Replica, scheduled: Schedule) -> None:
    """The worker polls every minute here: the approval itself must wake it,
    also for an execution behind hundreds of others awaiting a person."""
    created = deliver(replica, many(250))
    oldest = min(e["id"] for e in created)
    worker = replica.worker
    worker.interval = 60.0
    scheduled(worker)
    try:
        time.sleep(0.5)  # its first tick found nothing to run; now it sleeps a minute
        approve = f"/api/executions/{oldest}/approve"
        assert replica.client.post(approve, headers=AUTH).status_code == 200
        ran = wait_until(
            lambda: replica.store.get_execution(oldest).status == ExecutionStatus.SUCCEEDED, 10
        )
        assert ran, f"execution #{oldest} did not run within 10 s of its approval"
    finally:
        worker.stop()


def test_the_worker_and_the_expiry_read_their_partial_indexes(replica: Replica) -> None:
    """Finding work costs what is runnable (or expiring), not the journal's
    size: with 300 executions awaiting a person and statistics gathered, the
    store's queries are answered from ix_executions_runnable and
    ix_executions_awaiting, not from every pending row."""
    from vllm_runbook.runbooks.store.approvals import expired_ids_sql
    from vllm_runbook.runbooks.store.executions import runnable_ids_sql

    created = deliver(replica, many(300))
    approve = f"/api/executions/{created[0]['id']}/approve"
    assert replica.client.post(approve, headers=AUTH).status_code == 200
    store = replica.store
    params = {"after": 0, "limit": 100, "cutoff": "2000-01-01 00:00:00"}
    with store.session() as s:
        s.execute(text("ANALYZE"))
        plans = {}
        for index, sql in (
            ("ix_executions_runnable", runnable_ids_sql(store.dialect)),
            ("ix_executions_awaiting", expired_ids_sql(store.dialect)),
        ):
            if store.dialect == "postgresql":
                rows = s.scalars(text("EXPLAIN " + sql), params)
            else:
                rows = (r[-1] for r in s.execute(text("EXPLAIN QUERY PLAN " + sql), params))
            plans[index] = "\n".join(str(r) for r in rows)
    for index, plan in plans.items():
        assert index in plan and "ix_executions_status" not in plan, plan
    assert [r.id for r in store.runnable_executions()] == [created[0]["id"]]

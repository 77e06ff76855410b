"""Claims that expire, keys that repeat, events that commit with their change;
on SQLite and PostgreSQL.

A replica killed while it sends a notification leaves its claim to lapse;
another replica then sends it again, with the same key, so the receiver can
drop the duplicate (at least once). An event is appended in the transaction
that changes its execution, and becomes visible in id order, so a feed that
remembers the last id it read misses none."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from vllm_runbook.runbooks.service.notify import Notifier, Receiver
from vllm_runbook.runbooks.store import Journal
from vllm_runbook.runbooks.store.models import (
    NOTIFY_DELIVERED,
    NOTIFY_QUEUED,
    ApprovalState,
    Execution,
    ExecutionStatus,
)

from tests.service.conftest import Schedule
from tests.service.test_service_notify import Hooks, closed_port

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def store(db_url: str) -> Iterator[Journal]:
    s = Journal(db_url)
    yield s
    s.close()


@pytest.fixture
def hooks() -> Iterator[Hooks]:
    h = Hooks()
    yield h
    h.close()


def awaiting(store: Journal, n: int = 1) -> list[int]:
    """`n` alert executions awaiting approval (one event each)."""
    return [
        store.create_execution(
            "oom-pressure",
            "http://127.0.0.1:9",
            trigger="alert",
            who="alertmanager:VllmOOMPressure",
            alert_fingerprint=f"claims-{i}",
            alert_starts_at=datetime.now(UTC),
            reason=ApprovalState.AWAITING,
        )[0].id
        for i in range(n)
    ]


def wait_until(condition: Callable[[], bool], limit: float) -> bool:
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# A replica's notifier alone in a process: it claims, sends, and is killed
# while the receiver holds its request.
REPLICA = """
import sys, time
from vllm_runbook.runbooks.service.jobs import job_scheduler
from vllm_runbook.runbooks.service.notify import Notifier, Receiver
from vllm_runbook.runbooks.store import Journal
url, hook = sys.argv[1], sys.argv[2]
notifier = Notifier(Journal(url), [Receiver("ops", "webhook", hook)], retries=0, timeout_s=1.0,
                    claim_lease_s=4.0, interval_s=0.05)
scheduler = job_scheduler(notifier.job_count)
notifier.schedule(scheduler)
scheduler.start()
time.sleep(600)
"""


def test_a_claim_held_by_a_killed_replica_is_sent_by_another_with_its_key(
    store: Journal, db_url: str, hooks: Hooks, tmp_path: Path, scheduled: Schedule
) -> None:
    [execution_id] = awaiting(store)
    log = tmp_path / "replica.log"
    with open(log, "wb") as out:
        dead = subprocess.Popen(
            [sys.executable, "-c", REPLICA, db_url, hooks.url + "/hold"],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
    try:
        # The receiver has the message; the replica waits for the answer: kill it.
        assert hooks.holding.wait(60), log.read_text()
        os.kill(dead.pid, signal.SIGSTOP)  # frozen at once: its timeout cannot fire
        os.kill(dead.pid, signal.SIGKILL)
        dead.wait(10)
    finally:
        if dead.poll() is None:
            dead.kill()
            dead.wait(10)
    [row] = store.notifications([execution_id])[execution_id]
    assert (row.status, row.claims) == (NOTIFY_QUEUED, 1)  # claimed, never finished

    other = Notifier(
        store,
        [Receiver("ops", "webhook", hooks.url + "/ok")],
        retries=0,
        timeout_s=1.0,
        claim_lease_s=4.0,
        interval_s=0.05,
    )
    scheduled(other)
    try:
        assert wait_until(lambda: bool(hooks.bodies.get("/ok")), 30), "never sent again"
        assert wait_until(
            lambda: store.notifications([execution_id])[execution_id][0].status == NOTIFY_DELIVERED,
            10,
        )
    finally:
        other.stop()
    [first] = hooks.bodies["/hold"]
    [again] = hooks.bodies["/ok"]
    [event] = store.events_of_execution(execution_id)
    # The same event, the same key: the receiver drops the second.
    assert (first["event"], first["key"]) == ("awaiting approval", event.key)
    assert (again["event"], again["key"]) == ("awaiting approval", event.key)
    assert again["text"].splitlines()[-1] == f"Event key: {event.key}"
    [row] = store.notifications([execution_id])[execution_id]
    assert (row.status, row.attempts, row.claims, row.event_key) == (
        NOTIFY_DELIVERED,
        1,
        2,
        event.key,
    )


def test_a_replica_that_stops_hands_its_claims_over_at_once(store: Journal, hooks: Hooks) -> None:
    """Stopped while it waits to retry an unreachable receiver: its claims go
    back to the queue now, not when the lease lapses."""
    ids = awaiting(store, 3)
    down = Receiver("ops", "webhook", f"http://127.0.0.1:{closed_port()}/hook")
    stopping = Notifier(
        store, [down], retries=3, backoff_s=30.0, timeout_s=1.0, claim_lease_s=600.0
    )
    assert stopping.poll() == 3
    worker = threading.Thread(target=stopping.send_queued, args=(down,))
    worker.start()
    assert wait_until(
        lambda: sum(n.claims for rows in store.notifications(ids).values() for n in rows) == 3,
        30,
    )
    time.sleep(0.3)  # first attempt failed: now in its 30 s backoff
    stopping.stop()
    worker.join(10)
    assert not worker.is_alive()
    rows = [n for rows in store.notifications(ids).values() for n in rows]
    assert [(n.status, n.claims) for n in rows] == [(NOTIFY_QUEUED, 1)] * 3
    ok = Receiver("ops", "webhook", hooks.url + "/ok")
    other = Notifier(store, [ok], retries=0, timeout_s=1.0, claim_lease_s=600.0)
    assert other.send_queued(ok) == 3  # no wait for a 600 s lease
    assert sorted(b["execution_id"] for b in hooks.bodies["/ok"]) == ids
    other.stop()


def test_an_event_commits_with_its_change_and_ids_become_visible_in_order(
    store: Journal,
) -> None:
    from vllm_runbook.runbooks.store.events import append_events

    first, second, third = awaiting(store, 3)
    base = max(e.id for e in store.events_after(0))
    # A change that rolls back leaves no event.
    with pytest.raises(RuntimeError), store.session(write=True) as s:
        row = s.get(Execution, first)
        assert row is not None
        row.status, row.reason = ExecutionStatus.REFUSED, "rolled back below"
        s.flush()
        raise RuntimeError("rolled back")
    assert [e.event for e in store.events_of_execution(first)] == ["awaiting approval"]

    # T1 appends its event and is still open; T2 changes another execution meanwhile.
    # T2's event must not become visible before T1's (a reader would move its
    # cursor past T1's id and never see it): T2 waits until T1 commits.
    t2_done = threading.Event()

    def t2() -> None:
        store.decide(third, "rejected", "bob")
        t2_done.set()

    with store.session(write=True) as s:
        row = s.get(Execution, second)
        assert row is not None
        row.status, row.reason = ExecutionStatus.REFUSED, "T1"
        s.flush()
        assert append_events(s, [second]) == 1
        thread = threading.Thread(target=t2)
        thread.start()
        time.sleep(1.0)
        assert not t2_done.is_set()
        assert [e.id for e in store.events_after(base)] == []  # T1 not committed yet
    thread.join(30)
    assert t2_done.is_set()
    feed = store.events_after(base)
    assert [(e.execution_id, e.event) for e in feed] == [(second, "refused"), (third, "refused")]
    assert feed[0].id < feed[1].id
    assert len({e.key for e in store.events_after(0)}) == 5  # one key per event

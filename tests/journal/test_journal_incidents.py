"""Incidents in the store (written by the rules engine), on real SQLite and PostgreSQL."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

import pytest
from vllm_runbook.runbooks.store import IncidentRecord, Journal

T0 = datetime(2026, 3, 1, 12, 0, 0, 250000, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def put(
    store: Journal,
    state: str,
    *,
    alert: str = "VllmOOMPressure",
    engine: str = "llama-0",
    first: float = 0,
    last: float = 0,
    value: float | None = 0.97,
    severity: str = "critical",
    **kw: object,
) -> IncidentRecord | None:
    return store.record_incident(
        alert,
        engine,
        state=state,
        severity=severity,
        value=value,
        first_seen=at(first),
        last_seen=at(last),
        labels={"alertname": alert, "runbook": "oom-pressure"},
        **kw,  # type: ignore[arg-type]
    )


def test_pending_firing_resolved_is_one_row(store: Journal) -> None:
    pending = put(store, "pending")
    assert pending is not None
    assert (pending.id, pending.state, pending.first_seen, pending.resolved_at) == (
        1,
        "pending",
        T0,
        None,
    )
    firing = put(store, "firing", first=99, last=30, value=0.99)
    assert firing is not None
    # Same row; first_seen kept from the opening, the rest refreshed.
    assert (firing.id, firing.state, firing.first_seen, firing.last_seen, firing.value) == (
        1,
        "firing",
        T0,
        at(30),
        0.99,
    )
    resolved = put(store, "resolved", last=45, value=0.5, resolved_at=at(50))
    assert resolved is not None
    assert (resolved.id, resolved.state, resolved.last_seen, resolved.resolved_at) == (
        1,
        "resolved",
        at(45),
        at(50),
    )
    assert resolved.value == 0.5 and resolved.open is False
    assert resolved.labels == {"alertname": "VllmOOMPressure", "runbook": "oom-pressure"}
    assert resolved.first_seen.tzinfo is UTC


def test_one_open_incident_per_alert_and_engine(store: Journal) -> None:
    put(store, "firing")
    put(store, "firing", engine="llama-1")
    put(store, "firing", alert="VllmLatencySpike")
    put(store, "firing", last=5)  # the same open incident again
    assert [(r.alert, r.engine) for r in store.list_incidents(open_only=True)] == [
        ("VllmLatencySpike", "llama-0"),
        ("VllmOOMPressure", "llama-1"),
        ("VllmOOMPressure", "llama-0"),
    ]
    put(store, "resolved", last=10)
    # A new episode after the resolution is a new incident; the old one stays as history.
    # (Its id is not asserted: PostgreSQL spends a sequence value on every upsert.)
    reopened = put(store, "pending", first=60, last=60)
    assert reopened is not None and reopened.id > 3
    rows = store.list_incidents(engine="llama-0", alert="VllmOOMPressure")
    assert [(r.id, r.state) for r in rows] == [(reopened.id, "pending"), (1, "resolved")]
    open_rows = store.list_incidents(open_only=True, engine="llama-0")
    assert [r.id for r in open_rows] == [reopened.id, 3]


def test_firing_is_never_set_back_to_pending(store: Journal) -> None:
    put(store, "firing")
    again = put(store, "pending", last=20, value=0.96)
    assert again is not None
    assert (again.state, again.last_seen, again.value) == ("firing", at(20), 0.96)


def test_resolving_nothing_open_returns_none(store: Journal) -> None:
    assert put(store, "resolved") is None
    assert store.list_incidents() == []


def test_discard_only_removes_a_pending_incident(store: Journal) -> None:
    put(store, "pending")
    assert store.discard_pending_incident("VllmOOMPressure", "llama-0") is True
    assert store.list_incidents() == []
    put(store, "firing")
    assert store.discard_pending_incident("VllmOOMPressure", "llama-0") is False
    assert [r.state for r in store.list_incidents()] == ["firing"]


def test_touch_refreshes_open_incidents_only(store: Journal) -> None:
    put(store, "firing")
    put(store, "firing", engine="llama-1")
    put(store, "resolved", engine="llama-1", last=1)
    touched = store.touch_incidents(
        [("VllmOOMPressure", "llama-0", 0.98, at(40)), ("VllmOOMPressure", "llama-1", 0.5, at(40))]
    )
    assert touched == 1
    [open_row] = store.list_incidents(open_only=True)
    assert (open_row.engine, open_row.value, open_row.last_seen) == ("llama-0", 0.98, at(40))
    [closed] = store.list_incidents(engine="llama-1")
    assert (closed.value, closed.last_seen) == (0.97, at(1))


def test_resolve_stale_closes_firing_and_drops_pending(store: Journal) -> None:
    put(store, "firing", last=10)  # stale
    put(store, "pending", engine="llama-1", last=10)  # stale, never fired
    put(store, "firing", engine="llama-2", last=100)  # fresh
    closed = store.resolve_stale_incidents(at(50), at=at(120))
    assert [(r.engine, r.state, r.resolved_at) for r in closed] == [
        ("llama-0", "resolved", at(120))
    ]
    assert [(r.engine, r.state) for r in store.list_incidents()] == [
        ("llama-2", "firing"),
        ("llama-0", "resolved"),
    ]
    with pytest.raises(ValueError, match="timezone-aware"):
        store.resolve_stale_incidents(datetime(2026, 1, 1), at=at(0))


def test_non_finite_values_are_stored_as_null(store: Journal) -> None:
    record = put(store, "firing", value=math.inf)
    assert record is not None and record.value is None
    assert record.to_dict()["value"] is None
    assert record.to_dict()["first_seen"] == "2026-03-01T12:00:00.250000+00:00"


def test_bad_state_is_refused(store: Journal) -> None:
    with pytest.raises(ValueError, match="incident state 'inactive'"):
        put(store, "inactive")


def test_concurrent_writers_open_one_incident(store: Journal) -> None:
    # Several replicas (threads here, each its own connection) racing to open
    # the same incident: the open_key unique constraint makes it one row.
    stores = [Journal(store.url) for _ in range(4)]
    try:
        with ThreadPoolExecutor(4) as pool:
            ids = list(pool.map(lambda s: put(s, "firing").id, stores * 3))  # type: ignore[union-attr]
    finally:
        for s in stores:
            s.close()
    assert set(ids) == {1}
    assert len(store.list_incidents()) == 1

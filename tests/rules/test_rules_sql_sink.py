"""The evaluator recording into the real store (SQLite and PostgreSQL) through SqlIncidentSink."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from vllm_runbook.rules import condition as C
from vllm_runbook.rules.evaluator import Evaluator, store_for_rules
from vllm_runbook.rules.incidents import engine_name
from vllm_runbook.rules.model import Rule
from vllm_runbook.rules.signals import SIGNALS
from vllm_runbook.runbooks.service.sql_sink import SqlIncidentSink
from vllm_runbook.runbooks.store import Journal, StoreUnavailable

WAITING = SIGNALS["requests_waiting"].metric
T0 = 1_700_000_000.0


def dt(seconds: float) -> datetime:
    return datetime.fromtimestamp(T0 + seconds, UTC)


def rule(severity: str = "warning", threshold: float = 10.0, for_seconds: float = 20.0) -> Rule:
    cond = C.Compare(C.Instant(C.Selector(SIGNALS["requests_waiting"])), ">", threshold)
    return Rule(
        "VllmHotPathBacklog",
        severity,
        "backlog on {{ $labels.engine }}",
        "{{ $value }} waiting",
        "latency-spike",
        for_seconds,
        {},
        {},
        cond,
        "test",
        "test.yaml",
        1,
    )


class Harness:
    def __init__(self, store: Journal, rules: list[Rule], rank: str = "0", **sink: Any) -> None:
        self.windows = store_for_rules(rules)
        self.sink = SqlIncidentSink(store, **sink)
        self.evaluator = Evaluator(rules, self.windows, self.sink)
        self.store = store
        self.labels = {"model_name": "m", "engine": rank}

    def step(self, t: float, waiting: float) -> list[str]:
        self.windows.add("llama-0", WAITING, self.labels, T0 + t, waiting)
        return [e.state for e in self.evaluator.evaluate(T0 + t)]

    def rows(self) -> list[tuple[Any, ...]]:
        return [
            (r.state, r.severity, r.value, r.first_seen, r.last_seen, r.resolved_at)
            for r in self.store.list_incidents()
        ]


def test_pending_firing_resolved_in_the_store(incident_store: Journal) -> None:
    h = Harness(incident_store, [rule()])
    assert h.step(0, 0) == []
    assert h.step(10, 20) == ["pending"]
    assert h.rows() == [("pending", "warning", 20.0, dt(10), dt(10), None)]
    h.step(20, 25)
    assert h.step(30, 30) == ["firing"]
    assert h.rows() == [("firing", "warning", 30.0, dt(10), dt(30), None)]
    assert h.step(40, 0) == ["resolved"]
    # Resolved at the evaluation that found it false; last seen at the one before.
    assert h.rows() == [("resolved", "warning", 30.0, dt(10), dt(30), dt(40))]
    [row] = incident_store.list_incidents()
    assert (row.alert, row.engine) == ("VllmHotPathBacklog", "llama-0")
    assert row.labels == {
        "alertname": "VllmHotPathBacklog",
        "instance": "llama-0",
        "model_name": "m",
        "engine": "0",
        "severity": "warning",
        "runbook": "latency-spike",
    }


def test_pending_that_clears_leaves_no_incident(incident_store: Journal) -> None:
    h = Harness(incident_store, [rule()])
    h.step(0, 20)
    assert [r[0] for r in h.rows()] == ["pending"]
    assert h.step(10, 0) == ["inactive"]
    assert h.rows() == []


def test_two_severities_are_one_incident(incident_store: Journal) -> None:
    h = Harness(incident_store, [rule("warning", 10, 0), rule("critical", 50, 0)])
    assert h.step(0, 20) == ["firing"]
    assert h.step(10, 60) == ["firing"]  # the critical one
    assert h.rows() == [("firing", "critical", 60.0, dt(0), dt(10), None)]
    assert h.step(20, 30) == ["resolved"]  # critical clears; the warning still holds
    # Severity steps down at once; value and last_seen are the critical's last
    # until the next refresh (the warning sent no event: its state did not change).
    assert h.rows() == [("firing", "warning", 60.0, dt(0), dt(10), None)]
    h.sink.refresh(h.evaluator.open_alerts(), T0 + 20)
    assert h.rows() == [("firing", "warning", 30.0, dt(0), dt(20), None)]
    assert h.step(30, 0) == ["resolved"]
    assert h.rows() == [("resolved", "warning", 30.0, dt(0), dt(20), dt(30))]


def test_engine_name_carries_the_dp_rank(incident_store: Journal) -> None:
    assert engine_name(("llama-0", "m", "0")) == "llama-0"
    assert engine_name(("llama-0", "m", "3")) == "llama-0/dp3"
    h = Harness(incident_store, [rule(for_seconds=0)], rank="3")
    h.step(0, 20)
    assert [r.engine for r in incident_store.list_incidents()] == ["llama-0/dp3"]


def test_refresh_touches_open_incidents_and_resolves_stale_ones(incident_store: Journal) -> None:
    # An incident a previous run left open, last seen at t=0.
    incident_store.record_incident(
        "VllmOOMPressure",
        "llama-9",
        state="firing",
        severity="critical",
        value=1.0,
        first_seen=dt(0),
        last_seen=dt(0),
    )
    h = Harness(incident_store, [rule(for_seconds=0)], touch_every=30.0, stale_after=100.0)
    h.step(50, 20)
    h.sink.refresh(h.evaluator.open_alerts(), T0 + 50)
    h.step(60, 40)
    h.sink.refresh(h.evaluator.open_alerts(), T0 + 60)  # within touch_every: no write
    assert h.rows()[0][2:5] == (20.0, dt(50), dt(50))
    h.step(120, 45)
    h.sink.refresh(h.evaluator.open_alerts(), T0 + 120)
    assert [
        (r.engine, r.state, r.value, r.last_seen, r.resolved_at)
        for r in incident_store.list_incidents()
    ] == [
        ("llama-0", "firing", 45.0, dt(120), None),
        ("llama-9", "resolved", 1.0, dt(0), dt(120)),
    ]


class FlakyStore(Journal):
    """The real store, with an outage switch."""

    down = False

    def record_incident(self, *args: Any, **kwargs: Any) -> Any:
        if self.down:
            raise StoreUnavailable("store sqlite:///x unavailable: database is locked")
        return super().record_incident(*args, **kwargs)


def test_writes_queue_while_the_store_is_down(incident_store: Journal) -> None:
    flaky = FlakyStore(incident_store.url)
    try:
        h = Harness(flaky, [rule()])
        flaky.down = True
        assert h.step(0, 20) == ["pending"]  # the cycle goes on
        assert h.step(20, 20) == ["firing"]
        assert h.rows() == [] and len(h.sink._backlog) == 2
        flaky.down = False
        assert h.step(30, 0) == ["resolved"]  # queued writes first, in order
        assert h.rows() == [("resolved", "warning", 20.0, dt(0), dt(20), dt(30))]
        assert not h.sink._backlog
    finally:
        flaky.close()

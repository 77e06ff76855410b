"""Evaluator state machine and window store, on hand-made samples."""

from __future__ import annotations

import dataclasses
import math

from vllm_runbook.rules import condition as C
from vllm_runbook.rules.evaluator import Evaluator, store_for_rules
from vllm_runbook.rules.incidents import MemoryIncidentSink
from vllm_runbook.rules.model import Rule
from vllm_runbook.rules.signals import SIGNALS
from vllm_runbook.rules.window import WindowStore

ENGINE = {"model_name": "m", "engine": "0"}
WAITING = SIGNALS["requests_waiting"].metric


def rule(for_seconds: float, threshold: float = 10.0) -> Rule:
    cond = C.Compare(C.Instant(C.Selector(SIGNALS["requests_waiting"])), ">", threshold)
    return Rule(
        "VllmTest",
        "warning",
        "s {{ $labels.engine }}",
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


def run(r: Rule, values: list[float | None], step: float = 10.0) -> list[tuple[str, float, float]]:
    store = store_for_rules([r])
    sink = MemoryIncidentSink()
    ev = Evaluator([r], store, sink)
    for i, v in enumerate(values):
        if v is not None:
            store.add("i-0", WAITING, ENGINE, i * step, v)
        ev.evaluate(i * step)
    return [(e.state, e.at, e.first_seen) for e in sink.events]


def test_pending_firing_resolved() -> None:
    events = run(rule(20.0), [0, 20, 20, 20, 20, 0])
    assert events == [("pending", 10, 10), ("firing", 30, 10), ("resolved", 50, 10)]


def test_pending_that_clears_never_fires() -> None:
    assert run(rule(20.0), [0, 20, 20, 0, 0]) == [("pending", 10, 10), ("inactive", 30, 10)]


def test_for_zero_fires_at_once() -> None:
    assert run(rule(0.0), [20, 0]) == [("firing", 0, 0), ("resolved", 10, 0)]


def test_nan_never_fires() -> None:
    assert run(rule(0.0), [math.nan, math.nan]) == []


def test_value_goes_absent_after_five_minutes_without_samples() -> None:
    # one sample at 0 s, then nothing: Prometheus looks back 5 minutes (left-open in 3.x)
    events = run(rule(0.0), [20] + [None] * 31)
    assert events == [("firing", 0, 0), ("resolved", 300, 0)]


def test_event_carries_labels_value_and_rendered_annotations() -> None:
    r = rule(0.0)
    store = store_for_rules([r])
    sink = MemoryIncidentSink()
    store.add("i-0", WAITING, ENGINE, 0.0, 42.0)
    Evaluator([r], store, sink).evaluate(5.0)
    [e] = sink.events
    assert (e.engine, e.value, e.summary, e.description) == (
        ("i-0", "m", "0"),
        42.0,
        "s 0",
        "42 waiting",
    )
    assert dict(e.labels) == {
        "alertname": "VllmTest",
        "instance": "i-0",
        "model_name": "m",
        "engine": "0",
        "severity": "warning",
        "runbook": "latency-spike",
    }


def test_engines_are_evaluated_separately() -> None:
    r = rule(0.0)
    store = store_for_rules([r])
    sink = MemoryIncidentSink()
    store.add("i-0", WAITING, ENGINE, 0.0, 42.0)
    store.add("i-1", WAITING, ENGINE, 0.0, 1.0)
    store.add("i-0", WAITING, {"model_name": "m", "engine": "1"}, 0.0, 11.0)
    Evaluator([r], store, sink).evaluate(1.0)
    assert sorted(e.engine for e in sink.events) == [("i-0", "m", "0"), ("i-0", "m", "1")]


def test_store_keeps_only_wanted_series_and_trims_to_retention() -> None:
    store = WindowStore({"a": 100.0}, counters={"a"})
    assert store.add("i", "b", ENGINE, 0.0, 1.0) is None
    assert store.add("i", "a", {"engine": "0"}, 0.0, 1.0) is None  # no model_name: not an engine
    for t in range(0, 1000, 10):
        store.add("i", "a", ENGINE, float(t), float(t))
    [series] = store.engines[("i", "m", "0")].by_name["a"]
    store.trim(1000.0)
    assert (len(series), series.ts[series.start]) == (10, 900.0)
    assert len(series.ts) < 100  # compacted, not only skipped
    store.trim(2000.0)
    assert store.engines == {}


def test_counter_reset_is_folded_into_adjusted_values() -> None:
    store = WindowStore({"c": 1e9}, counters={"c"})
    for t, v in enumerate([5.0, 10.0, 2.0, 4.0]):
        store.add("i", "c", ENGINE, float(t), v)
    [s] = store.engines[("i", "m", "0")].by_name["c"]
    assert list(s.adjusted or []) == [5.0, 10.0, 12.0, 14.0]


def test_range_bounds_follow_prometheus_version() -> None:
    closed = WindowStore({"g": 1e9}, left_open=False)
    left_open = WindowStore({"g": 1e9}, left_open=True)
    for store in (closed, left_open):
        for t in range(0, 100, 10):
            store.add("i", "g", ENGINE, float(t), 1.0)
    [a] = closed.engines[("i", "m", "0")].by_name["g"]
    [b] = left_open.engines[("i", "m", "0")].by_name["g"]
    assert closed.bounds(a, 90.0, 30.0) == (6, 10)  # 60, 70, 80, 90
    assert left_open.bounds(b, 90.0, 30.0) == (7, 10)  # 70, 80, 90


def test_unless_drops_an_engine_only_where_the_exclusion_holds() -> None:
    """PromQL's `unless`: the kept condition's value, except where the excluded one
    holds; an absent or NaN exclusion excludes nothing."""
    running = SIGNALS["requests_running"]
    kept = rule(0.0).condition
    excluded = C.Compare(C.Instant(C.Selector(running)), ">", 8.0)
    r = dataclasses.replace(rule(0.0), condition=C.Unless(kept, excluded))
    store = store_for_rules([r])
    sink = MemoryIncidentSink()
    for instance, running_now in (("absent", None), ("nan", math.nan), ("low", 2.0), ("high", 9.0)):
        store.add(instance, WAITING, ENGINE, 0.0, 42.0)
        if running_now is not None:
            store.add(instance, running.metric, ENGINE, 0.0, running_now)
    Evaluator([r], store, sink).evaluate(1.0)
    assert sorted((e.engine[0], e.value) for e in sink.events) == [
        ("absent", 42.0),
        ("low", 42.0),
        ("nan", 42.0),
    ]

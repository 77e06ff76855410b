"""Exact oracles for what the executor reads after a change: the longest
context in the running batch, requests finished by reason, per-request queue
and end-to-end times, and counter deltas from the step a change applied at."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from vllm_runbook.collector import metrics as M
from vllm_runbook.collector.agent_api import SettledSince
from vllm_runbook.collector.control import parse_command

from tests.engines import InProcessEngine, http_get

pytestmark = pytest.mark.engine


class FakeWallClock:
    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clocked(engine: InProcessEngine) -> Iterator[FakeWallClock]:
    import time

    collector = engine.collector
    saved = collector.wall_clock
    clock = FakeWallClock(time.time())
    collector.wall_clock = clock
    try:
        yield clock
    finally:
        collector.wall_clock = saved


def _longest_in_flight(engine: InProcessEngine) -> int:
    return max((r.num_computed_tokens for r in engine.scheduler.running), default=0)


def test_max_sequence_tokens_is_the_longest_context_in_flight(engine: InProcessEngine) -> None:
    for i, n in enumerate((40, 70, 100)):
        engine.add(f"longest-{i}", n, max_tokens=4, offset=6000 + 150 * i)
    engine.step()  # prefill: contexts 40, 70, 100
    assert engine.value(M.MAX_SEQUENCE_TOKENS.name) == 100 == _longest_in_flight(engine)
    engine.step()  # first decode: 101
    assert engine.value(M.MAX_SEQUENCE_TOKENS.name) == 101 == _longest_in_flight(engine)
    engine.run_until_done()
    assert engine.value(M.MAX_SEQUENCE_TOKENS.name) == 0  # nothing runs


def test_requests_finished_by_reason_with_queue_and_e2e_times(
    engine: InProcessEngine, clocked: FakeWallClock
) -> None:
    collector = engine.collector
    before = {
        r: engine.value(M.REQUESTS_FINISHED.series_name, reason=r) for r in ("length", "abort")
    }
    start = clocked.now
    engine.add("fin-0", 50, max_tokens=3, offset=7000)
    engine.add("fin-1", 60, max_tokens=3, offset=7100)
    engine.add("gone", 30, max_tokens=3, offset=7200)
    engine.engine.abort_request(["gone"])  # never scheduled: waited 0 s on this clock
    clocked.now = start + 5.0
    engine.step()  # first schedule of fin-0, fin-1: queue time 5 s each
    clocked.now = start + 12.0
    engine.run_until_done()  # both finish at +12 s (length: max_tokens reached)

    assert engine.value(M.REQUESTS_FINISHED.series_name, reason="length") == before["length"] + 2
    assert engine.value(M.REQUESTS_FINISHED.series_name, reason="abort") == before["abort"] + 1
    recent = [e for e in collector.requests.log.entries if e.time >= start]
    by_reason = {e.reason for e in recent}
    assert by_reason == {"length", "abort"}
    finished = [e for e in recent if e.reason == "length"]
    assert [e.queue_seconds for e in finished] == [5.0, 5.0]
    # In the engine from +0 s to +12 s on the collector's clock.
    assert [e.e2e_seconds for e in finished] == [12.0, 12.0]
    # The windowed view in /v1/state: the three requests finished in the window.
    stats = collector.state().stats
    assert stats.engine_e2e_latency_p99 == 12.0
    assert stats.engine_queue_time_p99 == 5.0
    assert stats.error_rate == 0.0


def _histogram(engine: InProcessEngine, spec: M.MetricSpec) -> dict[str, float]:
    les = ("0.01", "5.0", "10.0", "20.0", "+Inf")
    values = {le: engine.value(spec.name + "_bucket", le=le) or 0.0 for le in les}
    values["sum"] = engine.value(spec.name + "_sum") or 0.0
    values["count"] = engine.value(spec.name + "_count") or 0.0
    return values


def test_queue_and_e2e_histograms_record_each_request_at_its_finish(
    engine: InProcessEngine, clocked: FakeWallClock
) -> None:
    queue0 = _histogram(engine, M.REQUEST_QUEUE_SECONDS)
    e2e0 = _histogram(engine, M.REQUEST_E2E_SECONDS)
    start = clocked.now
    engine.add("hist-0", 50, max_tokens=3, offset=7300)
    engine.add("hist-1", 60, max_tokens=3, offset=7400)
    engine.add("hist-gone", 30, max_tokens=3, offset=7500)
    engine.engine.abort_request(["hist-gone"])  # finished at +0 s: queue 0 s, e2e 0 s
    clocked.now = start + 5.0
    engine.step()  # first schedule of hist-0, hist-1: queue 5 s each
    assert _histogram(engine, M.REQUEST_E2E_SECONDS)["count"] == e2e0["count"] + 1
    clocked.now = start + 12.0
    engine.run_until_done()  # both finish at +12 s

    queue = _histogram(engine, M.REQUEST_QUEUE_SECONDS)
    e2e = _histogram(engine, M.REQUEST_E2E_SECONDS)
    # Cumulative buckets (le): 0 s in 0.01; 5 s in 5.0 (a bound counts its own value).
    assert {k: queue[k] - queue0[k] for k in queue} == {
        "0.01": 1,
        "5.0": 3,
        "10.0": 3,
        "20.0": 3,
        "+Inf": 3,
        "sum": 10.0,
        "count": 3,
    }
    assert {k: e2e[k] - e2e0[k] for k in e2e} == {
        "0.01": 1,
        "5.0": 1,
        "10.0": 1,
        "20.0": 3,
        "+Inf": 3,
        "sum": 24.0,
        "count": 3,
    }
    # The same series on the agent's /metrics.
    status, text = http_get(str(engine.collector.server.url) + "/metrics")
    assert status == 200
    assert f"{M.REQUEST_E2E_SECONDS.name}_count{{" in text
    assert f"{M.REQUEST_QUEUE_SECONDS.name}_bucket{{" in text


def test_since_step_counts_from_the_step_a_change_applied(
    engine: InProcessEngine, clocked: FakeWallClock
) -> None:
    collector = engine.collector
    engine.run_until_done()
    # Idle engine: the change applies now, from the next step.
    result = collector.control.submit(
        parse_command({"max_num_seqs": 63}), idle=collector.engine_idle
    )
    step = result.effective_from_step
    assert step == collector.stats.steps + 1
    applied_at = clocked.now
    assert collector.since(step - 1) is None  # no change took effect there
    tokens_before = collector.stats.scheduled_tokens
    for i in range(4):
        engine.add(f"since-{i}", 64, max_tokens=2, offset=8000 + 100 * i)
    clocked.now = applied_at + 30.0
    engine.run_until_done()
    since = collector.since(step)
    assert isinstance(since, SettledSince)
    assert since.from_step == step
    assert since.seconds == 30.0
    assert since.steps == collector.stats.steps - (step - 1)
    assert since.scheduled_tokens == collector.stats.scheduled_tokens - tokens_before == 4 * 64 + 4
    assert since.preemptions == 0 and since.preemptions_per_minute == 0.0
    assert since.requests_finished == 4
    assert since.finished_by_reason["length"] == 4
    assert since.scheduled_tokens_per_second == pytest.approx(since.scheduled_tokens / 30.0)
    # The same over HTTP, and a malformed step is a 400.
    url = engine.collector.server.url
    status, body = http_get(f"{url}/v1/state?since_step={step}")
    assert status == 200 and json.loads(body)["since"]["requests_finished"] == 4
    assert json.loads(http_get(f"{url}/v1/state")[1])["since"] is None
    assert http_get(f"{url}/v1/state?since_step=x")[0] == 400
    # No GPU here: NVML says so, per-GPU values are empty.
    assert json.loads(body)["gpus"] == {"nvml_up": False, "per_gpu": {}, "hardware": {}}
    collector.control.submit(parse_command({}, restore=True), idle=collector.engine_idle)


def test_a_cap_whose_batch_drains_to_idle_is_in_effect(
    engine: InProcessEngine, clocked: FakeWallClock
) -> None:
    """max_num_seqs cut below the running batch: the limit is in effect once the
    running fall to it. They fall when requests finish (update_from_output); here
    the whole batch finishes at one step and nothing waits, so the engine calls
    schedule() no more: the change must read as in effect, not draining for ever."""
    collector, scheduler = engine.collector, engine.scheduler
    engine.run_until_done()
    for i in range(4):  # one batch, finishing together
        engine.add(f"drain-{i}", 32, max_tokens=3, offset=7000 + 100 * i)
    engine.step()
    assert len(scheduler.running) == 4
    # Applied between steps (as the engine thread does at its next schedule()).
    result = collector.control.submit(parse_command({"max_num_seqs": 2}), idle=lambda: True)
    step = result.effective_from_step
    draining = collector.since(step)
    assert draining is not None and not draining.settled
    assert (draining.requests_running, draining.max_num_seqs) == (4, 2)
    finished = engine.run_until_done()
    assert sorted(finished) == [f"drain-{i}" for i in range(4)]
    since = collector.since(step)
    assert isinstance(since, SettledSince), since
    # In effect from the step after the one that finished the batch.
    assert since.effective_step == collector.stats.steps + 1
    assert since.requests_finished == 0
    # The same drained by aborts (finish_requests), with no step after them.
    for i in range(4):
        engine.add(f"abort-{i}", 32, max_tokens=8, offset=7500 + 100 * i)
    engine.step()
    result = collector.control.submit(parse_command({"max_num_seqs": 1}), idle=lambda: True)
    step = result.effective_from_step
    assert not collector.since(step).settled  # type: ignore[union-attr]
    engine.engine.abort_request([f"abort-{i}" for i in range(4)])
    assert not scheduler.running
    since = collector.since(step)
    assert isinstance(since, SettledSince), since
    assert since.effective_step == collector.stats.steps + 1
    collector.control.submit(parse_command({}, restore=True), idle=collector.engine_idle)


def test_since_step_says_what_happened_as_long_before_the_change(
    engine: InProcessEngine, clocked: FakeWallClock
) -> None:
    """The breaker's comparison: the counters over as long a time before the
    change, from the history's one-second samples (the latest at or before
    that moment: the window may be longer, never shorter, than asked)."""
    collector = engine.collector
    engine.run_until_done()
    # Past every earlier sample (the tests before ran their clocks 30 s ahead).
    clocked.now += 100.0
    t0 = clocked.now
    for i in range(3):  # sampled at t0 before they finish
        engine.add(f"before-a{i}", 32, max_tokens=2, offset=9000 + 100 * i)
    engine.run_until_done()
    clocked.now = t0 + 20.0
    for i in range(2):  # sampled at t0 + 20 before they finish
        engine.add(f"before-b{i}", 32, max_tokens=2, offset=9500 + 100 * i)
    engine.run_until_done()
    clocked.now = t0 + 40.0
    result = collector.control.submit(
        parse_command({"max_num_seqs": 62}), idle=collector.engine_idle
    )
    step = result.effective_from_step
    clocked.now = t0 + 70.0
    engine.add("before-after", 32, max_tokens=2, offset=9900)
    engine.run_until_done()
    since = collector.since(step)
    assert isinstance(since, SettledSince) and since.seconds == 30.0
    assert since.requests_finished == 1
    # 30 s before the change is t0 + 10: the latest sample at or before it is t0's.
    assert since.before is not None
    assert since.before.model_dump() == {
        "seconds": 40.0,
        "preemptions": 0,
        "requests_finished": 5,
        "errors": 0,
        "engine_e2e_latency_p99": 0.0,  # the fake clock stood still while each ran
    }
    # Asked right after the change: the sample at t0 + 20 (2 finished since).
    clocked.now = t0 + 45.0
    assert collector.since(step) is not None
    early = collector.changes.before(collector.changes.marks.get(step), 5.0)  # type: ignore[arg-type]
    assert early is not None and (early.seconds, early.requests_finished) == (20.0, 2)
    collector.control.submit(parse_command({}, restore=True), idle=collector.engine_idle)

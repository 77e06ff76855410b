"""Every runbook that changes an engine, three ways, on one real CPU engine.

For each: (1) the fix works: the runbook's own condition, made by traffic,
is judged improved by its shipped verification, the change is kept, and the
alert resolving reverts it as the runbook says; (2) the fix does not work:
the condition comes from something the action cannot change, the journal
names the signal with both values, and the knobs are restored as the runbook
says; (3) nothing to fix: the condition is gone by the checks, the run is
refused before any change with "nothing to improve", no knob touched.

One engine serves every scenario (startup: priority policy, max_num_seqs
32, budget 512, 256 KV blocks of 32 tokens, a 10 s collector window); each
scenario sets the knobs it needs through the agent and leaves the engine
idle, at its startup knobs. The executor runs in a thread of this process
(the shipped catalog, the shipped deadlines unless a scenario says why it
shortens one) while the test steps the engine.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from matrix_bench import STARTUP, Bench, start_engine
from vllm_runbook.runbooks.run.executor import ExecutionResult, Executor
from vllm_runbook.runbooks.run.render import format_signal
from vllm_runbook.runbooks.store import Journal

from tests.engines import InProcessEngine

pytestmark = pytest.mark.engine

WINDOW_S = 10
LOW, HIGH = 10, 0  # vLLM: the lower value is served first


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[InProcessEngine]:
    eng = start_engine(tiny_model, WINDOW_S)
    yield eng
    eng.close()


@pytest.fixture(autouse=True)
def _finished() -> Iterator[None]:
    """A test that failed mid-scenario leaves nothing in the engine for the next one."""
    yield
    Bench.finish_unfinished()


def refused_as_nothing_to_improve(bench: Bench, result: ExecutionResult, reason: str) -> None:
    record = result.record
    assert (result.exit_code, record.status, record.display_status) == (
        0,
        "refused",
        "nothing to improve",
    )
    assert record.reason == reason
    assert (record.steps, record.verification, record.error) == ((), None, None)
    assert bench.knobs() == STARTUP
    assert [e.event for e in bench.store.events_of_execution(record.id)] == ["nothing to improve"]


# --- latency-spike ---------------------------------------------------------------------


def test_latency_spike_works_starved_requests_get_in(engine: InProcessEngine, db_url: str) -> None:
    b = Bench(engine, db_url, "ls-works")
    b.client.set_knobs(max_num_seqs=4)
    for _ in range(4):  # a high-priority stream fills every slot...
        b.add(20, 8, HIGH)
    b.step()
    for _ in range(4):  # ...and four low-priority requests wait
        b.add(20, 4, LOW)

    def stream() -> None:  # one more high-priority request every step
        b.add(20, 8, HIGH)
        b.step()

    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:  # starving: over the runbook's 1 s
        stream()
    result = b.execute("latency-spike", stream)
    record = result.record
    assert (result.exit_code, record.status) == (0, "succeeded"), record.error
    v = record.verification
    assert v is not None
    # Judged on the requests starving at the switch: the oldest waiting (8 at
    # most: the four low ones and the high ones queued before them) all got in.
    assert (v["signal"], v["outcome"], v["after"]) == ("starving_waiting", "improved", 0)
    assert 4 <= v["before"] == v["drain"]["starving_at_change"] <= 8
    assert v["deadline_seconds"] <= 120  # from the drain rate, capped by the runbook's
    assert b.knobs()["policy"] == "fcfs"  # kept
    reverted = b.resolve("latency-spike")
    assert reverted.record.status == "succeeded"
    assert b.store.get_execution(record.id).status == "reverted"
    assert b.knobs()["policy"] == "priority"
    b.finish()


def test_latency_spike_does_not_work_when_no_slot_frees(
    engine: InProcessEngine, db_url: str
) -> None:
    """One slot, held by a long request: the queue does not move in any order."""
    b = Bench(engine, db_url, "ls-blocked")
    b.client.set_knobs(max_num_seqs=1, max_num_batched_tokens=512)
    b.add(16, 1000)  # holds the only slot for 1,000 steps
    b.step()
    for _ in range(5):
        b.add(16, 4)
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        b.step()
    # The drain rate before the switch is ~0: the deadline is the runbook's,
    # shortened here to 4 s (nothing is admitted within a 1,000-step request).
    result = b.execute("latency-spike", verify_seconds=4)
    record = result.record
    assert (result.exit_code, record.status) == (1, "failed")
    v = record.verification
    assert v is not None
    assert (v["signal"], v["outcome"], v["before"], v["after"]) == (
        "starving_waiting",
        "no measurable change",
        5,
        5,
    )
    assert record.error is not None
    assert record.error.startswith(
        "verification: no measurable change in starving_waiting (5 → 5; needed "
        "starving_waiting = 0 (every request starving at the change scheduled))"
    )
    # The runbook keeps the switch until its alert resolves, then restores it.
    assert b.knobs()["policy"] == "fcfs"
    reverted = b.resolve("latency-spike")
    assert reverted.record.status == "succeeded"
    assert b.knobs()["policy"] == "priority"
    b.finish()


def test_latency_spike_nothing_to_fix_when_no_request_waits(
    engine: InProcessEngine, db_url: str
) -> None:
    b = Bench(engine, db_url, "ls-nothing")
    b.add(16, 4)
    b.engine.run_until_done()  # served: nothing waits any more
    result = b.execute("latency-spike")
    refused_as_nothing_to_improve(
        b,
        result,
        "nothing to improve: oldest_waiting = 0, the runbook acts only if oldest_waiting > 1",
    )
    b.finish()


# --- restore ---------------------------------------------------------------------------


def test_restore_works_every_knob_back_at_startup(engine: InProcessEngine, db_url: str) -> None:
    b = Bench(engine, db_url, "restore-works")
    b.client.set_knobs(max_num_seqs=8, policy="fcfs")
    b.add(16, 2)
    b.step()
    result = b.execute("restore")
    record = result.record
    # No verification: the knobs at their startup values are the whole effect.
    assert (result.exit_code, record.status, record.reason) == (0, "succeeded", "no verification")
    (step,) = record.steps
    assert (step.action, step.status) == ("restore_knobs", "applied")
    assert step.before is not None and step.after == STARTUP
    assert (step.before["max_num_seqs"], step.before["policy"]) == (8, "fcfs")
    assert b.knobs() == STARTUP
    b.finish()


def test_restore_nothing_to_fix_at_startup_knobs(engine: InProcessEngine, db_url: str) -> None:
    b = Bench(engine, db_url, "restore-nothing")
    result = b.execute("restore")
    refused_as_nothing_to_improve(
        b,
        result,
        "nothing to improve: every step would change nothing "
        "(restore_knobs: every knob is at its startup value)",
    )
    b.finish()


# --- hot-path-backlog ------------------------------------------------------------------


def test_hot_path_backlog_works_hot_requests_first(engine: InProcessEngine, db_url: str) -> None:
    """Hot (short) requests queued behind warm ones in arrival order; tiered serves them first."""
    b = Bench(engine, db_url, "hot-works")
    b.client.set_knobs(max_num_seqs=4)
    for _ in range(8):
        b.add(600, 120)  # warm tier (256 ≤ prompt < 1024)
    b.step()
    for _ in range(40):
        b.add(32, 4)  # hot tier, behind four more warm ones
    for _ in range(20):
        b.step()
    result = b.execute("hot-path-backlog", verify_seconds=60)
    record = result.record
    assert (result.exit_code, record.status) == (0, "succeeded"), record.error
    v = record.verification
    assert v is not None
    assert (v["signal"], v["outcome"], v["before"]) == ("tier_requests_waiting_hot", "improved", 40)
    assert v["after"] <= 32  # ≤ 80 % of before
    assert b.knobs()["policy"] == "tiered"
    reverted = b.resolve("hot-path-backlog")
    assert reverted.record.status == "succeeded"
    assert b.knobs()["policy"] == "priority"
    b.finish()


def test_hot_path_backlog_does_not_work_when_only_hot_requests_queue(
    engine: InProcessEngine, db_url: str
) -> None:
    """Every request is hot and the queue is refilled as it is served: no tier to put
    ahead, the hot queue stays as long (within the runbook's 10 % tolerance)."""
    b = Bench(engine, db_url, "hot-flat")
    b.client.set_knobs(max_num_seqs=2)
    depth = 42  # 2 running + 40 waiting (a read between admission and refill: ≥ 38)

    def closed_loop() -> None:
        while len(engine.scheduler.requests) < depth:
            b.add(32, 4)
        b.step()

    for _ in range(10):
        closed_loop()
    result = b.execute("hot-path-backlog", closed_loop, verify_seconds=6)
    record = result.record
    assert (result.exit_code, record.status) == (1, "failed")
    v = record.verification
    assert v is not None
    assert (v["signal"], v["outcome"]) == ("tier_requests_waiting_hot", "no measurable change")
    assert 38 <= v["before"] <= 40 and 38 <= v["after"] <= 40
    assert record.error is not None
    assert record.error.startswith(
        f"verification: no measurable change in tier_requests_waiting_hot "
        f"({v['before']} → {v['after']}; needed tier_requests_waiting_hot ≤ 80% of before)"
    )
    assert b.knobs()["policy"] == "tiered"  # kept until the alert resolves
    reverted = b.resolve("hot-path-backlog", closed_loop)
    assert reverted.record.status == "succeeded"
    assert b.knobs()["policy"] == "priority"
    b.finish()


def test_hot_path_backlog_nothing_to_fix_when_no_hot_request_waits(
    engine: InProcessEngine, db_url: str
) -> None:
    b = Bench(engine, db_url, "hot-nothing")
    result = b.execute("hot-path-backlog")
    refused_as_nothing_to_improve(
        b,
        result,
        "nothing to improve: tier_requests_waiting_hot = 0, the runbook acts only if "
        "tier_requests_waiting_hot > 0",
    )
    b.finish()


# --- oom-pressure, batch-too-large, kv-hit-low: nothing to fix on an idle engine ------


def test_oom_pressure_nothing_to_fix_without_preemptions(
    engine: InProcessEngine, db_url: str
) -> None:
    b = Bench(engine, db_url, "oom-nothing")
    for _ in range(4):
        b.add(64, 8)
    b.engine.run_until_done()
    result = b.execute("oom-pressure")
    refused_as_nothing_to_improve(
        b,
        result,
        "nothing to improve: preemptions_per_minute = 0, the runbook acts only if "
        "preemptions_per_minute > 0",
    )
    b.finish()


def test_batch_too_large_nothing_to_fix_when_the_kv_cache_holds_more_than_it_admits(
    engine: InProcessEngine, db_url: str
) -> None:
    b = Bench(engine, db_url, "batch-nothing")
    for _ in range(2):
        b.add(40, 600)  # 2 blocks each at first: the cache holds over 100 such
    b.step()

    def slow() -> None:
        b.step()
        time.sleep(0.04)

    result = b.execute("batch-too-large", slow)
    record = result.record
    assert record.checks["kv_capacity"]["value"] >= 32
    refused_as_nothing_to_improve(
        b,
        result,
        "nothing to improve: every step would change nothing (set_max_num_seqs: kv_capacity "
        f"{record.checks['kv_capacity']['value']} >= max_num_seqs 32: nothing to lower)",
    )
    b.finish()


def test_kv_hit_low_nothing_to_fix_when_the_hit_ratio_is_back(
    engine: InProcessEngine, db_url: str
) -> None:
    b = Bench(engine, db_url, "kv-nothing")
    # One prompt, again and again: 30 of its 31 blocks hit; enough of them that the
    # 10 s window's lookups of earlier scenarios (measured: 0.80 with 40) do not count.
    for _ in range(120):
        engine.add(f"kv-nothing-{b.sent}", 992, max_tokens=1, offset=5)
        b.sent += 1
        engine.run_until_done()
    result = b.execute("kv-hit-low")
    ratio = result.record.checks["kv_hit_ratio"]["value"]
    assert ratio >= 0.85
    refused_as_nothing_to_improve(
        b,
        result,
        f"nothing to improve: kv_hit_ratio = {format_signal('kv_hit_ratio', ratio)}, the "
        "runbook acts only if kv_hit_ratio < 0.85",
    )
    b.finish()


def test_oom_pressure_works_preemptions_fall_and_the_alert_resolving_restores(
    engine: InProcessEngine, db_url: str
) -> None:
    """64 x (300 + 300) tokens into 256 KV blocks of 32 at max_num_seqs 32: a storm."""
    b = Bench(engine, db_url, "oom-works")
    for _ in range(64):
        b.add(300, 300)
    start = engine.collector.stats.preemptions
    while engine.collector.stats.preemptions - start < 20:  # the storm is on
        b.step()

    def paced() -> None:
        b.step()
        time.sleep(0.01)

    # The conditional cap's wait shortened (shipped 30 s): the storm must still be on.
    result = b.execute("oom-pressure", paced, condition_seconds=3)
    record = result.record
    assert (result.exit_code, record.status) == (0, "succeeded"), record.error
    v = record.verification
    assert v is not None
    assert (v["signal"], v["outcome"]) == ("preemptions_per_minute", "improved")
    assert v["before"] > 0 and v["after"] <= 0.5 * v["before"]
    assert record.steps[0].action == "scale_max_num_batched_tokens"
    assert record.steps[0].status == "applied"
    assert b.knobs()["max_num_batched_tokens"] == 256  # kept
    b.abort_all()
    reverted = b.resolve("oom-pressure")  # stepwise 50 % → 100 %, no healthy wait here
    assert reverted.record.status == "succeeded"
    assert b.store.get_execution(record.id).status == "reverted"
    assert b.knobs() == STARTUP
    b.finish()


def test_restore_cannot_work_when_the_engine_is_gone(db_url: str) -> None:
    """The engine to restore does not answer: the restore cannot change that. It fails
    before any change, in one journaled line that names the engine and why."""
    from tests.engines import free_port

    down = f"http://127.0.0.1:{free_port()}"
    store = Journal(db_url)
    try:
        result = Executor(store, poll_seconds=0.2).execute(
            "restore", down, trigger="cli", who="oncall", approved=True
        )
        record = result.record
        assert (result.exit_code, record.status, record.steps) == (3, "failed", ())
        assert record.error is not None
        assert record.error.startswith(f"engine {down} unreachable: ")
        assert "\n" not in record.error
        assert store.get_execution(record.id).status == "failed"
    finally:
        store.close()

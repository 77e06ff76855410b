"""Every runbook that changes an engine, three ways, on one real CPU engine.

For each: (1) the fix works: the runbook's own condition, made by traffic,
is judged improved by its shipped verification, the change is kept, and the
alert resolving reverts it as the runbook says; (2) the fix does not work:
the condition comes from something the action cannot change, the journal
names the signal with both values, and the knobs are restored as the runbook
says; (3) nothing to fix: the condition is gone by the checks, the run is
refused before any change with "nothing to improve", no knob touched.

throughput-drop changes nothing (a block size needs a restart): its advice is
tested both ways, smaller blocks where fragmentation is measured, larger ones
where schedule() takes the engine's time.

The diagnose-only padding-high runbook changes nothing: its scenarios check
that each of its checks reads the engine exactly and that each piece of
advice is given on its own evidence only.

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
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from matrix_bench import STARTUP, Bench, start_engine
from vllm_runbook.collector import metrics as M
from vllm_runbook.runbooks.run.executor import ExecutionResult, Executor
from vllm_runbook.runbooks.run.hold import premature_revert, reapply
from vllm_runbook.runbooks.run.render import format_check, format_signal
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


# --- padding-high (diagnose only) ------------------------------------------------------


def padding_scenario(b: Bench, prompts: list[int], *, own_window: bool = False) -> list[int]:
    """Requests of these prompt lengths, stepped until each has decoded a token; the
    engine is then left alone (the checks and the step conditions read one state).
    `own_window`: first wait until the collector's window holds no earlier arrival.
    Returns the running requests' contexts (computed tokens)."""
    deadline = time.monotonic() + 2 * WINDOW_S
    while own_window and b.engine.collector.requests.arrived_prompt_tokens(WINDOW_S):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    for prompt in prompts:
        b.add(prompt, 100)
    running = b.engine.scheduler.running
    while len(running) < len(prompts) or any(
        r.num_computed_tokens <= r.num_prompt_tokens for r in running
    ):
        b.step()  # the 600-token prompts are chunked at the 512-token budget
    return sorted(r.num_computed_tokens for r in running)


def advice(record: Any) -> list[tuple[str, str, str | None]]:
    """(status, when, note) of each advise step, in order."""
    return [
        (s.status, s.params.get("when", ""), s.params.get("note"))
        for s in record.steps
        if s.action == "advise"
    ]


def test_padding_high_flags_fragmentation_and_long_requests(
    engine: InProcessEngine, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Twelve 4-token prompts batched with one of 600: the report's checks in its
    order. The engine's max_model_len is 1,024, so the collector's long-prompt bound
    (8,192 tokens) is lowered to 512 here: the 600-token prompt stands for an 8k one."""
    monkeypatch.setattr(M, "LONG_PROMPT_TOKENS", 512)
    b = Bench(engine, db_url, "pad-long")
    contexts = padding_scenario(b, [4] * 12 + [600], own_window=True)
    assert contexts == [6] * 12 + [601]  # the long prompt took two steps (512 + 88)
    result = b.execute("padding-high", lambda: time.sleep(0.01))
    record = result.record
    assert (result.exit_code, record.status, record.verification) == (0, "succeeded", None)
    checks = {name: c["value"] for name, c in (record.checks or {}).items()}
    # 12 requests of 6 tokens in one block of 32 each, 601 tokens in 19 blocks.
    assert checks["fragmentation"] == 1 - (12 * 6 + 601) / ((12 + 19) * 32)
    assert checks["long_prompts"] == 1 / 13
    assert checks["longest_sequence"] == 601
    assert checks["length_padding"] == 1 - (12 * 6 + 601) / (13 * 601)
    assert checks["cudagraph_padding"] == 0.0  # a CPU engine runs no CUDA graph
    assert checks["running"] == 13
    assert [s.action for s in record.steps] == ["capture_diagnostics"] + ["advise"] * 4
    assert advice(record) == [
        ("applied", "block_fragmentation > 0.2", None),
        ("applied", "long_prompt_ratio > 0", None),
        ("skipped", "padding_ratio > 0.25", "condition not met (padding_ratio = 0)"),
        ("applied", "", None),
    ]
    assert b.knobs() == STARTUP  # advice only
    b.finish()


def test_padding_high_flags_nothing_on_requests_of_one_length(
    engine: InProcessEngine, db_url: str
) -> None:
    """Eight 62-token prompts (one step of the 512-token budget): one length, blocks
    nearly full, nothing over 8k. Only the lasting advice is given."""
    b = Bench(engine, db_url, "pad-even")
    contexts = padding_scenario(b, [62] * 8)
    assert contexts == [63] * 8
    result = b.execute("padding-high", lambda: time.sleep(0.01))
    record = result.record
    assert (result.exit_code, record.status) == (0, "succeeded")
    checks = {name: c["value"] for name, c in (record.checks or {}).items()}
    assert checks["fragmentation"] == 1 - 63 / 64  # two blocks each
    assert (checks["long_prompts"], checks["length_padding"]) == (0.0, 0.0)
    frag = format(checks["fragmentation"], "g")
    assert advice(record) == [
        (
            "skipped",
            "block_fragmentation > 0.2",
            f"condition not met (block_fragmentation = {frag})",
        ),
        ("skipped", "long_prompt_ratio > 0", "condition not met (long_prompt_ratio = 0)"),
        ("skipped", "padding_ratio > 0.25", "condition not met (padding_ratio = 0)"),
        ("applied", "", None),
    ]
    b.finish()


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

    def heavier() -> None:  # the stream outlasts the fix: more than the engine drains
        b.add(20, 8, HIGH)
        b.add(20, 8, HIGH)
        b.step()

    while b.client.state().stats.oldest_waiting < 3:
        heavier()
    # The alert resolves (the switch served the starving requests) while the
    # stream goes on: the switch holds, however often the worker looks.
    assert b.resolve("latency-spike", heavier) is None
    for _ in range(3):
        assert b.judge(heavier) is None
    held = b.store.get_execution(record.id)
    assert (held.display_status, held.hold_note) == (
        "holding",
        "the cause holds (oldest_waiting ≥ 2); reverts once oldest_waiting < 2 for 0 s on end",
    )
    assert b.knobs()["policy"] == "fcfs"
    b.abort_all()  # the stream ended, nothing waits: the cause is gone
    reverted = b.judge()
    assert reverted.record.status == "succeeded"
    assert b.store.get_execution(record.id).status == "reverted"
    assert b.knobs()["policy"] == "priority"
    b.finish()


def test_latency_spike_a_premature_revert_is_reapplied_once_then_a_person_decides(
    engine: InProcessEngine, db_url: str
) -> None:
    """The revert comes, the starvation comes back inside the watch: the FCFS
    switch is re-applied (not the runbook afresh), the revert is journaled
    premature and notified, and the next revert waits for a person."""
    b = Bench(engine, db_url, "ls-premature")
    b.client.set_knobs(max_num_seqs=4)

    def stream() -> None:  # more high-priority work than the engine drains
        b.add(20, 8, HIGH)
        b.add(20, 8, HIGH)
        b.step()

    for _ in range(4):
        b.add(20, 8, HIGH)
    b.step()
    for _ in range(4):
        b.add(20, 4, LOW)
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        stream()
    fix = b.execute("latency-spike", stream).record
    assert b.knobs()["policy"] == "fcfs"
    b.abort_all()  # a lull: the cause looks gone, the revert comes
    revert = b.resolve("latency-spike")
    assert revert.record.status == "succeeded" and b.knobs()["policy"] == "priority"
    # The stream is back and the starvation fires again 30 s after the revert
    # (inside latency-spike's watch: its verification's 120 s).
    assert revert.record.finished_at is not None
    again = revert.record.finished_at + timedelta(seconds=30)
    pending, _ = b.store.create_execution(
        "latency-spike",
        b.url,
        trigger="alert",
        who="alertmanager:matrix",
        alert_fingerprint=f"fp-{b.tag}-again",
        alert_starts_at=again,
    )
    found = premature_revert(b.executor, pending)
    assert found is not None and found.id == revert.record.id
    result = b.while_running(lambda: reapply(b.executor, pending, found), stream)
    assert result.record.status == "succeeded" and b.knobs()["policy"] == "fcfs"
    assert [(s.action, s.before, s.after) for s in result.record.steps] == [
        ("reapply_knobs", {"policy": "priority"}, {"policy": "fcfs"})
    ]
    marked = b.store.get_execution(revert.record.id)
    assert marked.premature and (marked.reverts_id, b.store.get_execution(fix.id).status) == (
        fix.id,
        "reverted",
    )
    assert [e.event for e in b.store.events_of_execution(marked.id)] == ["premature revert"]
    # Its alert resolves in a lull too: fix, revert, re-apply this hour. A person decides.
    b.abort_all()
    b.starts = again
    b.tag = f"{b.tag}-again"
    assert b.resolve("latency-spike") is None
    held = b.store.get_execution(pending.id)
    assert held.display_status == "holding" and held.hold_for_person
    assert b.knobs()["policy"] == "fcfs"
    by_person = b.while_running(lambda: b.executor.revert(pending.id, who="alice"), b.step)
    assert by_person.record.status == "succeeded" and b.knobs()["policy"] == "priority"
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
    # The runbook keeps the switch until its alert resolves and nothing waits
    # over 2 s (the queue is still stuck here: it holds), then restores it.
    assert b.knobs()["policy"] == "fcfs"
    assert b.resolve("latency-spike") is None
    b.abort_all()
    reverted = b.judge()
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
    b.abort_all()  # the backlog ended: nothing waits
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
    # ... and after: the hot queue is refilled as fast as it is served, the cause holds.
    assert b.resolve("hot-path-backlog", closed_loop) is None
    assert b.judge(closed_loop) is None
    held = b.store.get_execution(record.id)
    assert held.display_status == "holding" and held.hold_note is not None
    assert held.hold_note.startswith("the cause holds (tier_requests_waiting_hot ≥ 1")
    assert b.knobs()["policy"] == "tiered"
    b.abort_all()  # the hot stream ended
    reverted = b.judge()
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


# --- the checks read the episode, not the instant -----------------------------------------

WAVE, WAVE_PROMPT, WAVE_OUTPUT = 16, 24, 64  # 16 × 24 prompt tokens: one step admits them


def test_a_check_in_the_gap_between_two_waves_reports_the_waves_peak(
    engine: InProcessEngine, db_url: str
) -> None:
    """A burst in waves: oom-pressure's checks read after one wave ended and before the
    next, with nothing running. Each gauge reads 0 (or unavailable) now, and its peak
    and mean over the episode say what the wave was (the demo's report once showed
    only the zeros while its OOM finding fired)."""
    b = Bench(engine, db_url, "episode-gap")
    engine.collector.episode.samples.clear()  # the episode is this scenario's wave
    for _ in range(WAVE):
        b.add(WAVE_PROMPT, WAVE_OUTPUT)
    while engine.engine.has_unfinished_requests():
        b.step()
        time.sleep(0.03)  # ≈2.5 s of wave: the agent samples at most once a second
    result = b.execute("oom-pressure")  # in the gap: no request left
    assert result.record.status == "refused" and b.knobs() == STARTUP
    checks: dict[str, Any] = result.record.checks or {}
    running = checks["running"]
    # Every sample was taken while the whole wave ran (they finish together).
    assert running["value"] == 0
    assert running["episode"]["seconds"] == WINDOW_S  # the alert's few seconds, widened
    assert running["episode"]["samples"] >= 2
    assert (running["episode"]["peak"], running["episode"]["mean"]) == (WAVE, WAVE)
    longest = checks["max_sequence_tokens"]
    assert longest["value"] == 0
    assert WAVE_PROMPT <= longest["episode"]["peak"] < WAVE_PROMPT + WAVE_OUTPUT
    assert WAVE_PROMPT <= longest["episode"]["mean"] <= longest["episode"]["peak"]
    usage = checks["kv_usage"]
    usable = 255  # 256 blocks less vLLM's null block; 1 to 3 blocks of 32 per request
    assert usage["value"] == 0.0
    assert WAVE / usable <= usage["episode"]["peak"] <= 3 * WAVE / usable
    capacity = checks["kv_capacity"]
    assert capacity["value"] is None and capacity["unavailable"].startswith("no request running")
    assert usable * WAVE // (3 * WAVE) <= capacity["episode"]["peak"] <= usable
    assert format_check(running).startswith(f"0 now; peak {WAVE}, mean {WAVE} over {WINDOW_S} s")
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


# --- throughput-drop: the block size by what was measured, both ways ----------------------


def advice_of(result: ExecutionResult) -> tuple[dict[str, Any], dict[str, Any]]:
    """The advise_block_size step's journaled advice and what it measured."""
    record = result.record
    assert (result.exit_code, record.status, record.reason) == (0, "succeeded", "no verification")
    assert [s.action for s in record.steps] == ["capture_diagnostics", "advise_block_size"]
    step = record.steps[1]
    assert step.status == "applied" and step.after is not None
    return step.after, step.params["measured"]


def test_throughput_drop_advises_smaller_blocks_when_fragmentation_is_measured(
    engine: InProcessEngine, db_url: str
) -> None:
    """32 requests of 2 + at most 6 tokens in blocks of 32: most of every block is empty,
    and schedule() is a small share of the engine's time. The advice is smaller blocks,
    with the figures; on the CPU vLLM takes no size below 32, which it says."""
    b = Bench(engine, db_url, "td-frag")

    def closed_loop() -> None:
        while len(engine.scheduler.requests) < 32:
            b.add(2, 6)
        b.step()

    for _ in range(10):
        closed_loop()
    after, measured = advice_of(b.execute("throughput-drop", closed_loop))
    frag = measured["fragmentation"]
    share = measured["schedule_share"]
    # Contexts of 2-8 tokens: at most a quarter of a block of 32 holds tokens.
    assert frag["32"] >= 0.75 and frag["16"] >= 0.5 and frag["8"] < frag["16"]
    assert share is not None and share < 0.15
    assert (after["direction"], after["restart_block_size"]) == ("smaller", None)
    assert after["advice"].startswith(
        f"fragmentation {100 * frag['32']:.0f}% at 32 (goal < 15%), schedule() "
        f"{100 * share:.0f}% of the engine's time"
    )
    # No size meets 15 % (contexts under 8 tokens): the smallest measured, 8.
    assert after["advice"].endswith(
        f": smaller blocks (at 8 the fragmentation would be {100 * frag['8']:.0f}%), but "
        "none smaller than 32 here; vLLM on the CPU takes multiples of 32 only"
    )
    b.finish()


def test_throughput_drop_advises_larger_blocks_when_scheduling_dominates(
    engine: InProcessEngine, db_url: str
) -> None:
    """The block manager made slow (5 ms a slot allocation, as the reports' hash
    collisions did): schedule() takes a large share of the engine's time while 8
    requests of 112 + 16 tokens fill their blocks well (4 of 32, or 2 of 64: 128
    slots). The advice is larger blocks, 64, with the fragmentation it would cost."""
    b = Bench(engine, db_url, "td-sched")
    manager = engine.scheduler.kv_cache_manager
    allocate = manager.allocate_slots

    def slow_allocate(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.005)
        return allocate(*args, **kwargs)

    def closed_loop() -> None:
        while len(engine.scheduler.requests) < 8:
            b.add(112, 16)
        b.step()

    manager.allocate_slots = slow_allocate
    try:
        for _ in range(20):
            closed_loop()
        after, measured = advice_of(b.execute("throughput-drop", closed_loop))
    finally:
        del manager.allocate_slots  # the class's method again
    frag = measured["fragmentation"]
    share = measured["schedule_share"]
    # 112-127 tokens in 128 slots at 32 and at 64: at most 16 empty (12.5 %).
    assert frag["32"] <= 0.125 and frag["64"] <= 0.125
    assert share is not None and share >= 0.15
    assert measured["schedule_seconds_per_step"] >= 0.002
    assert (after["direction"], after["restart_block_size"]) == ("larger", 64)
    assert after["advice"].startswith(
        f"fragmentation {100 * frag['32']:.0f}% at 32 (goal < 15%), schedule() "
        f"{100 * share:.0f}% of the engine's time"
    )
    assert after["advice"].endswith(
        ": larger blocks, fewer to manage: restart with --block-size 64 (fragmentation "
        f"there {100 * frag['64']:.0f}%)"
    )
    b.finish()

"""The `tiered` policy and the per-tier signals on a real CPU engine stepped by hand.

The engine starts with the policy from the plugin's configuration
(VLLM_RUNBOOK_POLICY=tiered) and small tiers so that prompts stay short:
hot < 64 prompt tokens <= warm < 256 <= cold, one running request per tier
at most while another tier waits, aging 10 s per tier, no deadlines (the
tests below move a fake clock by seconds); the share and deadline tests set
theirs on the running engine (`_tiers`). Budget 512 tokens, chunked prefill on.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_runbook.collector import metrics as M
from vllm_runbook.collector.agent_api import TierSettings
from vllm_runbook.collector.control import Command, ControlError, parse_command

from tests.engines import InProcessEngine

pytestmark = pytest.mark.engine

TIER_ENV = {
    "VLLM_RUNBOOK_POLICY": "tiered",
    "VLLM_RUNBOOK_TIER_BOUNDARIES": "64,256",
    "VLLM_RUNBOOK_TIER_LIMITS": "1,1,1",
    "VLLM_RUNBOOK_TIER_AGING_SECONDS": "10",
    "VLLM_RUNBOOK_TIER_DEADLINES": "none,none,none",
}
PROMPT = {"h": 30, "w": 100, "c": 300}  # hot, warm, cold with the tiers above


class Clock:
    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def tiered_engine(tiny_model: Path) -> Iterator[InProcessEngine]:
    with pytest.MonkeyPatch.context() as mp:
        for key, value in TIER_ENV.items():
            mp.setenv(key, value)
        eng = InProcessEngine.start(tiny_model, max_model_len=2048)
    yield eng
    eng.close()


@pytest.fixture
def eng(tiered_engine: InProcessEngine) -> Iterator[InProcessEngine]:
    """The engine back at its startup knobs (tiered), with a test clock."""
    collector = tiered_engine.collector
    _apply(tiered_engine, {}, restore=True)
    tiered_engine.finished.clear()  # the tests reuse request names
    saved = collector.wall_clock
    saved_tiers = collector.control.tiers
    collector.wall_clock = Clock(time.time())
    try:
        yield tiered_engine
    finally:
        collector.wall_clock = saved
        tiered_engine.run_until_done()
        _tiers(tiered_engine, saved_tiers)
        _apply(tiered_engine, {}, restore=True)
        if "schedule" in vars(tiered_engine.scheduler):
            del tiered_engine.scheduler.schedule


def _tiers(engine: InProcessEngine, config: Any = None, **changes: Any) -> None:
    """Set the tier configuration on the running engine (the control and both queues)."""
    control = engine.collector.control
    config = config or dataclasses.replace(control.tiers, **changes)
    control.tiers = config
    for queue in (engine.scheduler.waiting, engine.scheduler.kv_holding_waiting):
        if hasattr(queue, "config"):
            queue.config = config


def _apply(engine: InProcessEngine, body: dict[str, Any], restore: bool = False) -> Any:
    # Between two steps of this thread: applied now, as at a step boundary.
    return engine.collector.control.submit(parse_command(body, restore=restore), idle=lambda: True)


def _clock(engine: InProcessEngine) -> Clock:
    clock = engine.collector.wall_clock
    assert isinstance(clock, Clock)
    return clock


def record(engine: InProcessEngine) -> list[dict[str, Any]]:
    """What each step really scheduled: admitted ids (without vLLM's suffix)
    and tokens per request."""
    scheduler = engine.scheduler
    original = scheduler.schedule
    steps: list[dict[str, Any]] = []

    def schedule(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        steps.append(
            {
                "admitted": [r.req_id.split("-")[0] for r in out.scheduled_new_reqs],
                "tokens": {k.split("-")[0]: v for k, v in out.num_scheduled_tokens.items()},
                "threshold": scheduler.scheduler_config.long_prefill_token_threshold,
            }
        )
        return out

    scheduler.schedule = schedule
    return steps


def add(
    engine: InProcessEngine,
    name: str,
    max_tokens: int = 2,
    prompt: int | None = None,
    priority: int = 0,
    extra_args: dict[str, Any] | None = None,
) -> None:
    global _offset
    _offset += 1  # a fresh prompt each time: no prefix-cache hit changes the tokens
    n = prompt if prompt is not None else PROMPT[name[0]]
    if extra_args is None:
        engine.add(name, n, max_tokens=max_tokens, offset=3001 * _offset, priority=priority)
        return
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm_runbook.collector.tiny_model import prompt_token_ids

    params = SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, temperature=0.0, extra_args=extra_args
    )
    prompt_ids = TokensPrompt(prompt_token_ids=prompt_token_ids(n, 3001 * _offset))
    engine.engine.add_request(name, prompt_ids, params, priority=priority)


_offset = 0


def admitted(steps: list[dict[str, Any]]) -> list[str]:
    return [rid for s in steps for rid in s["admitted"]]


def tier_values(engine: InProcessEngine, spec: M.MetricSpec) -> dict[str, float | None]:
    return {t: engine.value(spec.series_name, tier=t) for t in M.TIERS}


def test_started_tiered_from_the_plugin_configuration(eng: InProcessEngine) -> None:
    control = eng.collector.control
    assert control.knobs()["policy"] == "tiered" == control.startup["policy"]
    assert eng.value(M.SCHEDULER_POLICY.name, policy="tiered") == 1
    assert eng.value(M.SCHEDULER_POLICY.name, policy="fcfs") == 0
    state = eng.collector.state()
    assert state.tiers.config == TierSettings(
        boundaries=[64, 256],
        limits={"hot": 1, "warm": 1, "cold": 1},
        shares={"hot": 0.40, "warm": 0.45, "cold": 0.15},
        aging_seconds=10.0,
        deadlines={"hot": None, "warm": None, "cold": None},
    )


def test_tiered_order_is_priority_tier_arrival(eng: InProcessEngine) -> None:
    _apply(eng, {"max_num_seqs": 1})  # one at a time: the admission order shows
    steps = record(eng)
    for name in ("c0", "w0", "c1", "h0", "w1", "h1"):
        add(eng, name)
    add(eng, "c9", priority=-1)  # a client priority comes before the tier
    eng.run_until_done()
    assert admitted(steps) == ["c9", "h0", "h1", "w0", "w1", "c0", "c1"]
    assert {"c0", "c1", "c9", "h0", "h1", "w0", "w1"} <= set(eng.finished)


def test_aging_moves_a_waiting_request_up_one_tier_per_period(eng: InProcessEngine) -> None:
    clock = _clock(eng)
    _apply(eng, {"max_num_seqs": 1})
    steps = record(eng)
    start = clock.now
    add(eng, "c0")  # cold, in the engine from start
    clock.now = start + 5.0
    add(eng, "w0")  # warm, 5 s later
    add(eng, "h0")
    add(eng, "h1")
    add(eng, "h2")
    eng.step()  # +5 s: nothing aged yet
    assert admitted(steps) == ["h0"]
    while eng.scheduler.running:
        eng.step()
    clock.now = start + 15.0  # c0 waited 15 s: warm now; w0 10 s: hot, and before h1
    eng.step()
    assert admitted(steps) == ["h0", "w0"]
    while eng.scheduler.running:
        eng.step()
    clock.now = start + 20.0  # c0 waited 20 s: hot, and it arrived first of all
    eng.step()
    assert admitted(steps) == ["h0", "w0", "c0"]
    eng.run_until_done()
    assert admitted(steps) == ["h0", "w0", "c0", "h1", "h2"]


def test_per_tier_admission_limits_and_lending(eng: InProcessEngine) -> None:
    steps = record(eng)
    for name in ("c0", "c1", "c2", "h0", "h1"):
        add(eng, name, max_tokens=3)
    eng.step()
    # h0 and c0 fill their tiers' single slots; h1 and c1 wait for the other tier.
    assert steps[-1]["admitted"] == ["h0", "c0"]
    assert tier_values(eng, M.TIER_REQUESTS_WAITING) == {"hot": 1, "warm": 0, "cold": 2}
    assert tier_values(eng, M.TIER_REQUESTS_RUNNING) == {"hot": 1, "warm": 0, "cold": 1}
    eng.step()
    eng.step()  # h0, c0 decode their 2nd and 3rd tokens: nothing is admitted meanwhile
    assert admitted(steps) == ["h0", "c0"]
    eng.step()
    # h1 takes the hot slot, c1 the cold one; then no other tier waits: c2 borrows.
    assert steps[-1]["admitted"] == ["h1", "c1", "c2"]
    eng.run_until_done()
    assert {"c0", "c1", "c2", "h0", "h1"} <= set(eng.finished)


def test_long_requests_never_borrow_the_hot_tiers_free_slots(eng: InProcessEngine) -> None:
    _apply(eng, {"max_num_seqs": 3})
    steps = record(eng)
    for name in ("c0", "c1", "c2"):
        add(eng, name, max_tokens=4)
    eng.step()
    # Only cold requests wait, so the cold tier borrows the warm slot, but not
    # the hot one: c2 waits although one of the three sequences is free.
    assert steps[-1]["admitted"] == ["c0", "c1"]
    assert len(eng.scheduler.running) == 2
    add(eng, "h0", max_tokens=4)
    eng.step()
    assert steps[-1]["admitted"] == ["h0"]  # the short request gets in at once
    eng.run_until_done()
    assert admitted(steps) == ["c0", "c1", "h0", "c2"]
    assert {"c0", "c1", "c2", "h0"} <= set(eng.finished)


def test_a_long_prefill_leaves_the_hot_tier_its_share(eng: InProcessEngine) -> None:
    steps = record(eng)
    add(eng, "c0", prompt=1500)
    eng.step()  # alone: the whole 512-token budget
    assert steps[-1]["tokens"] == {"c0": 512}
    add(eng, "h0")
    eng.step()
    # Hot and cold have work: quotas 512 x 0.40/0.55 = 372 and 139; hot needs
    # 30 of its 372 and lends the rest: c0's chunk is 482, h0 takes 30.
    assert steps[-1]["tokens"] == {"c0": 482, "h0": 30}
    eng.step()  # h0 decodes one token; c0 the rest of its prompt (1500 - 512 - 482)
    assert steps[-1]["tokens"] == {"c0": 506, "h0": 1}
    # The per-step chunk limit is vLLM's own throughout: each chunk is cut by its tier.
    assert {s["threshold"] for s in steps} == {0}
    assert "_reserve_prefill_lookahead" not in vars(eng.scheduler)  # only inside a step
    _apply(eng, {"policy": "fcfs"})
    add(eng, "c1", prompt=1500)
    add(eng, "h1")
    eng.step()
    # fcfs: no shares; c1 arrived before h1 and takes the rest, h1 waits.
    assert steps[-1]["tokens"] == {"c0": 1, "c1": 511}


def test_every_tier_gets_its_share_of_the_step(eng: InProcessEngine) -> None:
    """A known queue, eight slots per tier: hot 2 x 30 tokens, warm 3 x 200,
    cold 1 x 1500, all waiting at once; budget 512, shares 40/45/15."""
    _tiers(eng, limits=(8, 8, 8))
    steps = record(eng)
    for name, prompt in (
        ("c0", 1500),
        ("w0", 200),
        ("w1", 200),
        ("w2", 200),
        ("h0", 30),
        ("h1", 30),
    ):
        add(eng, name, max_tokens=3, prompt=prompt)
    eng.step()
    # Demand hot 60, warm 512 (600, at most the budget), cold 512: hot gets
    # its 60 (of 204.8); the other 452 split 45:15 -> warm 339, cold 113. The
    # warm tier admits w0 (200) and a 139-token chunk of w1; w2 waits.
    assert steps[-1]["tokens"] == {"h0": 30, "h1": 30, "w0": 200, "w1": 139, "c0": 113}
    assert steps[-1]["admitted"] == ["h0", "h1", "w0", "w1", "c0"]
    eng.step()
    # Demand hot 2 (decodes), warm 1 + 61 + 200 = 262, cold 1387: hot 2, warm
    # its 262 (of 382.5 of the 510 left), cold the other 248.
    assert steps[-1]["tokens"] == {"h0": 1, "h1": 1, "w0": 1, "w1": 61, "c0": 248, "w2": 200}
    eng.run_until_done()
    assert {"c0", "w0", "w1", "w2", "h0", "h1"} <= set(eng.finished)


def test_a_missed_deadline_demotes_or_aborts_with_a_reason(eng: InProcessEngine) -> None:
    """Deadlines hot 0.1 s, warm 1 s; one request runs at a time."""
    _tiers(eng, deadlines=(0.1, 1.0, None))
    clock = _clock(eng)
    _apply(eng, {"max_num_seqs": 1})
    steps = record(eng)
    before = {
        spec.name: tier_values(eng, spec)
        for spec in (M.TIER_DEADLINE_DEMOTIONS, M.TIER_DEADLINE_ABORTS)
    }
    add(eng, "h0", max_tokens=4)
    eng.step()  # h0 runs; the others wait behind it
    add(eng, "h1")
    add(eng, "h2", extra_args={"vllm_runbook_on_deadline": "abort"})
    add(eng, "w0")
    clock.now += 0.05
    eng.step()  # nobody past a deadline yet
    clock.now += 0.1
    outputs = eng.step()  # h1 and h2 waited 0.15 s: h1 demoted, h2 aborted (it asked)
    aborted = [o for o in outputs if o.request_id == "h2"]
    assert len(aborted) == 1 and aborted[0].finished
    assert aborted[0].outputs[0].finish_reason == "abort"
    assert aborted[0].outputs[0].token_ids == []
    assert aborted[0].outputs[0].stop_reason == (
        "vllm-runbook: hot tier deadline 0.1 s passed (0.150 s waiting for a first "
        "schedule); aborted as the request asked"
    )
    # The queue holds h1 as warm now (the gauges keep counting by prompt length).
    assert eng.scheduler.waiting.tier_counts() == [0, 2, 0]
    eng.run_until_done()
    # h1 now competes as warm, with w0: by arrival, h1 first.
    assert admitted(steps) == ["h0", "h1", "w0"]
    after = {
        spec.name: tier_values(eng, spec)
        for spec in (M.TIER_DEADLINE_DEMOTIONS, M.TIER_DEADLINE_ABORTS)
    }
    deltas = {
        name: {t: (after[name][t] or 0) - (before[name][t] or 0) for t in M.TIERS} for name in after
    }
    assert deltas[M.TIER_DEADLINE_DEMOTIONS.name] == {"hot": 1, "warm": 0, "cold": 0}
    assert deltas[M.TIER_DEADLINE_ABORTS.name] == {"hot": 1, "warm": 0, "cold": 0}
    assert set(eng.finished) >= {"h0", "h1", "h2", "w0"}


def test_switching_policies_keeps_every_request_exactly_once(eng: InProcessEngine) -> None:
    _apply(eng, {"max_num_seqs": 1})
    steps = record(eng)
    for name in ("c0", "w0", "h0", "c1", "w1", "h1", "h2"):
        add(eng, name)
    eng.step()
    assert admitted(steps) == ["h0"]  # tiered
    _apply(eng, {"policy": "fcfs"})
    eng.run_until_done()
    # fcfs: arrival order of the rest, exactly as if it had never been tiered.
    assert admitted(steps) == ["h0", "c0", "w0", "c1", "w1", "h1", "h2"]
    assert len(admitted(steps)) == len(set(admitted(steps)))
    assert {"c0", "w0", "h0", "c1", "w1", "h1", "h2"} <= set(eng.finished)


def test_switch_priority_to_tiered_and_back(eng: InProcessEngine) -> None:
    _apply(eng, {"max_num_seqs": 1, "policy": "priority"})
    steps = record(eng)
    names = ("c0", "w0", "h0", "c1", "h1")
    for name in names:
        add(eng, name)
    eng.step()
    assert admitted(steps) == ["c0"]  # priority without client priorities: arrival
    _apply(eng, {"policy": "tiered"})
    while len(admitted(steps)) < 3:
        eng.step()
    assert admitted(steps) == ["c0", "h0", "h1"]
    _apply(eng, {"policy": "priority"})
    eng.run_until_done()
    assert admitted(steps) == ["c0", "h0", "h1", "w0", "c1"]
    assert set(names) <= set(eng.finished)


def test_per_tier_signals_exact_under_fcfs(eng: InProcessEngine) -> None:
    clock = _clock(eng)
    _apply(eng, {"policy": "fcfs", "max_num_seqs": 2})
    name = M.TIER_QUEUE_SECONDS.name
    series = ("_sum", "_count", "_bucket/2.5", "_bucket/5.0", "_bucket/10.0")

    def histogram() -> dict[str, tuple[float | None, ...]]:
        def one(tier: str, key: str) -> float | None:
            suffix, _, le = key.partition("/")
            return eng.value(name + suffix, tier=tier, **({"le": le} if le else {}))

        return {t: tuple(one(t, key) for key in series) for t in M.TIERS}

    before = histogram()
    start = clock.now
    for rid in ("h0", "w0", "c0", "h1"):
        add(eng, rid, max_tokens=2)
    assert tier_values(eng, M.TIER_REQUESTS_WAITING) == {"hot": 2, "warm": 1, "cold": 1}
    assert tier_values(eng, M.TIER_REQUESTS_RUNNING) == {"hot": 0, "warm": 0, "cold": 0}
    clock.now = start + 3.0
    assert tier_values(eng, M.TIER_OLDEST_WAITING) == {"hot": 3.0, "warm": 3.0, "cold": 3.0}
    eng.step()  # fcfs, two at a time: h0 and w0 after 3 s
    assert tier_values(eng, M.TIER_REQUESTS_WAITING) == {"hot": 1, "warm": 0, "cold": 1}
    assert tier_values(eng, M.TIER_REQUESTS_RUNNING) == {"hot": 1, "warm": 1, "cold": 0}
    clock.now = start + 7.0
    assert tier_values(eng, M.TIER_OLDEST_WAITING) == {"hot": 7.0, "warm": 0.0, "cold": 7.0}
    eng.step()  # h0, w0 finish (2 tokens)
    clock.now = start + 8.0
    eng.step()  # c0 and h1 after 8 s
    assert tier_values(eng, M.TIER_REQUESTS_WAITING) == {"hot": 0, "warm": 0, "cold": 0}
    assert tier_values(eng, M.TIER_OLDEST_WAITING) == {"hot": 0.0, "warm": 0.0, "cold": 0.0}
    eng.run_until_done()
    after = histogram()
    # (sum, count, le=2.5, le=5, le=10): hot waited 3 s and 8 s, warm 3 s, cold 8 s.
    expected = {"hot": (11.0, 2, 0, 1, 2), "warm": (3.0, 1, 0, 1, 1), "cold": (8.0, 1, 0, 0, 1)}
    for tier in M.TIERS:
        deltas = tuple(a - b for a, b in zip(after[tier], before[tier], strict=True))  # type: ignore[operator]
        assert deltas == expected[tier], tier


def test_bad_policy_and_tier_settings_are_refused(eng: InProcessEngine) -> None:
    with pytest.raises(ControlError, match="policy must be one of fcfs, priority, tiered"):
        parse_command({"policy": "hrrn"})
    with pytest.raises(ControlError, match="policy must be one of"):
        eng.collector.control.start_with_policy("lifo")
    assert isinstance(parse_command({"policy": "tiered"}), Command)


def test_a_failing_tiered_step_disables_the_collector_not_the_engine(
    tiered_engine: InProcessEngine,
) -> None:
    """Last in the module: it leaves the collector disabled."""
    eng = tiered_engine
    _apply(eng, {}, restore=True)
    eng.finished.clear()
    steps = record(eng)
    add(eng, "c0", prompt=1500)
    eng.step()
    add(eng, "h0")
    eng.step()
    assert steps[-1]["tokens"] == {"c0": 482, "h0": 30}  # the shares applied
    collector = eng.collector

    def broken() -> None:
        raise RuntimeError("injected tiered fault")

    collector.control.begin_tiered_step = broken  # type: ignore[method-assign]
    try:
        for name in ("c1", "h1", "w0"):
            add(eng, name)
        eng.run_until_done()
        assert {"c0", "h0", "c1", "h1", "w0"} <= set(eng.finished)
        assert collector.enabled is False and "injected tiered fault" in (collector.error or "")
        # vLLM's own chunks from the failing step on (no per-request cut left
        # on the scheduler); the queue keeps its order, without limits.
        assert eng.scheduler.scheduler_config.long_prefill_token_threshold == 0
        assert "_reserve_prefill_lookahead" not in vars(eng.scheduler)
    finally:
        del collector.control.begin_tiered_step
        del eng.scheduler.schedule
        collector.enabled, collector.error = True, None


def test_a_failing_share_cut_inside_schedule_never_reaches_vllm(
    tiered_engine: InProcessEngine,
) -> None:
    """The per-request cut runs inside vLLM's schedule(): a fault there gives
    vLLM its own chunk for that request, and the collector disables itself
    after the step. Last in the module with the test above: it leaves the
    collector disabled."""
    eng = tiered_engine
    _apply(eng, {}, restore=True)
    eng.finished.clear()
    collector = eng.collector
    collector.enabled, collector.error = True, None
    steps = record(eng)

    def broken(request: Any) -> int:
        raise RuntimeError("injected share fault")

    collector.control._tier_of_scheduled = broken
    try:
        add(eng, "c0", prompt=1500)
        eng.step()
        add(eng, "h0")
        eng.step()  # the cut fails: vLLM's own chunk, the whole budget (h0 waits)
        assert steps[-1]["tokens"] == {"c0": 512}
        assert collector.enabled is False and "injected share fault" in (collector.error or "")
        assert "_reserve_prefill_lookahead" not in vars(eng.scheduler)
        eng.run_until_done()
        assert {"c0", "h0"} <= set(eng.finished)
    finally:
        del collector.control._tier_of_scheduled
        del eng.scheduler.schedule
        collector.enabled, collector.error = True, None

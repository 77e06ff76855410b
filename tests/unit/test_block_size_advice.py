"""The block size by measurement, both ways (throughput-drop's advice), the
reports' sweep (`runbook tune`'s step 2), and the action that measures for both:
exact verdicts and texts from known measurements."""

from __future__ import annotations

from typing import Any

import pytest
from vllm_runbook.collector.agent_api import AgentState, GpuReading, Gpus
from vllm_runbook.collector.request_tracking import requests_in_engine
from vllm_runbook.rules.config_checks import (
    BlockSizeEvidence,
    block_size_direction,
    block_size_sweep,
    tune_block_size,
)
from vllm_runbook.runbooks.engine.block_size import (
    AdviseBlockSize,
    advise_block_size,
    evidence_from_reads,
)
from vllm_runbook.runbooks.engine.operations import ActionContext

from tests.rules.test_rules_config_checks import lengths, state

# What-if fragmentation of a chat mix in blocks of 32: high at 32, under 15 % at 8.
CHAT = {8: 0.06, 16: 0.18, 32: 0.31, 64: 0.55, 128: 0.77}
# Long contexts: little fragmentation anywhere up to 64.
LONG = {8: 0.002, 16: 0.004, 32: 0.01, 64: 0.03, 128: 0.21}


def evidence(
    fragmentation: dict[int, float],
    share: float | None,
    block: int = 32,
    platform: str = "cuda",
    per_step: float | None = 0.002,
    util: float | None = None,
) -> BlockSizeEvidence:
    return BlockSizeEvidence(block, platform, fragmentation, share, per_step, util)


# --- the direction ------------------------------------------------------------------


def test_fragmentation_measured_high_says_smaller_with_the_figures() -> None:
    d = block_size_direction(evidence(CHAT, 0.03))
    assert (d.direction, d.block_size) == ("smaller", 8)  # 16 is still at 18 %
    assert d.text == (
        "fragmentation 31% at 32 (goal < 15%), schedule() 3% of the engine's time (2.00 ms a "
        "step) (the reports: 3% normal, 15% when block management dominates): smaller "
        "blocks, fewer empty slots: restart with --block-size 8 (fragmentation there 6%)"
    )
    # The largest smaller size under the goal: the least management cost.
    d = block_size_direction(evidence({**CHAT, 16: 0.12}, 0.03))
    assert (d.direction, d.block_size) == ("smaller", 16)


def test_scheduling_measured_high_says_larger_with_the_figures() -> None:
    d = block_size_direction(evidence(LONG, 0.22, util=0.55))
    assert (d.direction, d.block_size) == ("larger", 64)
    assert d.text == (
        "fragmentation 1% at 32 (goal < 15%), schedule() 22% of the engine's time (2.00 ms a "
        "step) (the reports: 3% normal, 15% when block management dominates), GPU "
        "utilisation 55%: larger blocks, fewer to manage: restart with --block-size 64 "
        "(fragmentation there 3%)"
    )


def test_larger_blocks_are_not_advised_into_the_checklists_fragmentation_limit() -> None:
    d = block_size_direction(evidence(LONG, 0.22, block=64))
    assert (d.direction, d.block_size) == ("keep", None)
    assert d.text.endswith(
        ": larger blocks would help scheduling, but at 128 the fragmentation would be 21% "
        "(the checklist's limit 20%); keep 64"
    )


def test_both_high_or_neither_keeps_the_block_size() -> None:
    both = block_size_direction(evidence(CHAT, 0.4))
    assert (both.direction, both.block_size) == ("keep", None)
    assert both.text.endswith(
        ": both high, and a block size trades one for the other; keep 32 and look at the "
        "batch (max_num_seqs) first"
    )
    neither = block_size_direction(evidence(LONG, 0.05))
    assert (neither.direction, neither.block_size) == ("keep", None)
    assert neither.text.endswith(
        ": neither is high; the block size is not what costs throughput here"
    )


def test_without_a_scheduling_measurement_fragmentation_alone_decides() -> None:
    d = block_size_direction(evidence(CHAT, None, per_step=None))
    assert (d.direction, d.block_size) == ("smaller", 8)
    assert d.text.startswith(
        "fragmentation 31% at 32 (goal < 15%), schedule() share not measured (no requests "
        "ran between two reads): smaller blocks"
    )
    idle = block_size_direction(evidence({}, None))
    assert (idle.direction, idle.text) == (
        "keep",
        "no request ran while measuring: no fragmentation to judge by",
    )


def test_on_the_cpu_only_multiples_of_32() -> None:
    d = block_size_direction(evidence(CHAT, 0.03, platform="cpu"))
    assert (d.direction, d.block_size) == ("smaller", None)
    assert d.text.endswith(
        ": smaller blocks (at 8 the fragmentation would be 6%), but none smaller than 32 "
        "here; vLLM on the CPU takes multiples of 32 only"
    )
    # From 128, smaller is 32 or 64 on the CPU: the smallest it takes.
    d = block_size_direction(evidence(CHAT, 0.03, block=128, platform="cpu"))
    assert (d.direction, d.block_size) == ("smaller", 32)
    assert d.text.endswith("restart with --block-size 32 (fragmentation there 31%)")
    d = block_size_direction(evidence(LONG, 0.3, platform="cpu"))
    assert (d.direction, d.block_size) == ("larger", 64)


# --- the sweep (tune's step 2) --------------------------------------------------------


def test_the_sweep_stops_at_the_first_size_under_15_percent_from_16_down() -> None:
    sweep = block_size_sweep({**CHAT, 16: 0.12}, 32, None, "cuda")
    assert sweep.block_size == 16
    assert [(p.block_size, p.meets) for p in sweep.points] == [(16, True)]
    assert sweep.text == (
        "the reports' sweep from 16 down, the first size with fragmentation < 15% and GPU "
        "utilisation > 90% (16: 12%): 16 (its GPU utilisation is measured after the restart)"
    )
    sweep = block_size_sweep(CHAT, 32, None, "cuda")
    assert sweep.block_size == 8
    assert [(p.block_size, p.meets) for p in sweep.points] == [(16, False), (8, True)]


def test_the_sweep_passes_the_engines_own_size_when_its_utilisation_is_90_or_less() -> None:
    """At its own size the utilisation is measured: 85 % does not stop the loop."""
    what_if = {**CHAT, 16: 0.10}
    sweep = block_size_sweep(what_if, 16, 0.85, "cuda")
    assert sweep.block_size == 8
    assert sweep.points[0].utilization == 0.85 and not sweep.points[0].meets
    assert "(16: 10% at 85% GPU, 8: 6%): 8" in sweep.text
    assert block_size_sweep(what_if, 16, 0.95, "cuda").block_size == 16


def test_the_sweep_ends_at_its_last_size_when_none_meets_and_says_so() -> None:
    sweep = block_size_sweep({**CHAT, 8: 0.2}, 32, None, "cuda")
    assert sweep.block_size == 8
    assert sweep.text.endswith("(16: 18%, 8: 20%): none meets both, the loop ends at 8")


def test_the_sweep_on_the_cpu_restarts_at_the_smallest_size_it_takes() -> None:
    sweep = block_size_sweep(CHAT, 32, None, "cpu")
    assert sweep.block_size == 32
    assert sweep.text.endswith(
        ": 8 (its GPU utilisation is measured after the restart); vLLM on the CPU takes "
        "multiples of 32 only: 32 (fragmentation 31%)"
    )
    assert block_size_sweep({}, 32, None, "cpu").block_size is None


def test_tune_step_2_sweeps_the_running_requests_from_the_length_mix_size() -> None:
    """Chat prompts: from 16 down. Documents over 3k tokens: the reports' 32 is where
    the sweep starts (and 32 meets 15 % on long documents)."""
    chat = state(what_if={str(k): v for k, v in CHAT.items()}, prompts=lengths(60, 120, 250, 280))
    assert tune_block_size(chat)[0] == 8
    documents = state(
        what_if={str(k): v for k, v in LONG.items()}, prompts=lengths(3200, 4000, 6000, 9000)
    )
    size, why = tune_block_size(documents)
    assert size == 32
    assert why.startswith("the reports' sweep from 32 down") and "(32: 1%): 32" in why
    long_context = state(
        what_if={str(k): v for k, v in LONG.items()},
        prompts=lengths(20_000, 30_000, 33_000, 34_000),
    )
    size, why = tune_block_size(long_context)
    assert size == 64
    assert why.endswith(
        "; block size 64 costs about 5% more memory (the reports): keep it as headroom, "
        "--gpu-memory-utilization 0.8"
    )
    idle = state(what_if={str(k): v for k, v in CHAT.items()}, running=0)
    size, why = tune_block_size(idle)
    assert size == 16  # the length mix (P50 prompt 400): nothing running to sweep
    assert why.startswith("no request running to sweep; the reports: 8 for 50-300-token chat")


def test_tune_step_2_reads_the_gpu_utilisation_at_the_engines_own_size() -> None:
    s = state(
        config={"block_size": 16},
        what_if={str(k): v for k, v in {**CHAT, 16: 0.1}.items()},
        prompts=lengths(60, 120, 250, 280),
    )
    gpus = Gpus(
        nvml_up=True,
        per_gpu={"0": GpuReading(memory_used_bytes=1, memory_total_bytes=2, utilization_ratio=0.8)},
    )
    assert tune_block_size(s.model_copy(update={"gpus": gpus}))[0] == 8
    assert tune_block_size(s)[0] == 16


# --- the action's measurement -----------------------------------------------------------


def read(
    steps: int, schedule_sum: float, running: int = 8, what_if: dict[int, float] | None = None
) -> AgentState:
    base = state(
        config={"block_size": 32},
        what_if={str(k): v for k, v in (what_if or CHAT).items()},
        running=running,
    )
    return base.model_copy(
        update={
            "stats": base.stats.model_copy(update={"steps_total": steps}),
            "schedule_histogram": base.schedule_histogram.model_copy(
                update={"sum_seconds": schedule_sum}
            ),
        }
    )


def test_the_evidence_is_the_schedule_seconds_over_the_time_requests_ran() -> None:
    reads = [
        (10.0, read(100, 1.0, what_if=CHAT)),
        (11.0, read(300, 1.05, what_if={**CHAT, 32: 0.29})),
        (12.0, read(500, 1.10, running=0, what_if=CHAT)),  # idle: neither counted
        (13.0, read(500, 1.10, what_if={**CHAT, 32: 0.33})),
    ]
    e = evidence_from_reads(reads)
    assert e is not None
    assert (e.block_size, e.platform) == (32, "cuda")
    assert e.schedule_share == pytest.approx(0.05)  # 0.05 s over the 1 s both ran
    assert e.schedule_seconds_per_step == pytest.approx(0.05 / 200)
    assert e.fragmentation[32] == pytest.approx((0.31 + 0.29 + 0.33) / 3)
    assert e.gpu_utilization is None


class ScriptedAgent:
    def __init__(self, states: list[AgentState]) -> None:
        self.states = states
        self.url, self.timeout = "http://127.0.0.1:9", 1.0

    def state(self, since_step: int | None = None) -> AgentState:
        return self.states.pop(0)


def test_the_action_journals_the_direction_and_what_it_measured() -> None:
    """5 reads a second apart on an engine spending 20 % of its time in schedule()."""
    states = [read(100 * i, 0.2 * i, what_if=LONG) for i in range(6)]
    agent = ScriptedAgent(states[1:])
    times = iter(float(i) for i in range(6))
    waited: list[float] = []
    ctx = ActionContext(
        client=agent,  # type: ignore[arg-type]
        state=states[0],
        dry_run=False,
        begin=lambda before, details: None,
        wait=waited.append,
    )
    outcome = advise_block_size(AdviseBlockSize(seconds=5), ctx, clock=lambda: next(times))
    assert waited == [1.0] * 5
    assert outcome.after is not None
    assert (outcome.after["direction"], outcome.after["restart_block_size"]) == ("larger", 64)
    assert outcome.after["advice"].startswith(
        "fragmentation 1% at 32 (goal < 15%), schedule() 20% of the engine's time (2.00 ms a step)"
    )
    measured: dict[str, Any] = outcome.details["measured"]
    assert measured == {
        "block_size": 32,
        "fragmentation": {"8": 0.002, "16": 0.004, "32": 0.01, "64": 0.03, "128": 0.21},
        "schedule_share": 0.2,
        "schedule_seconds_per_step": 0.002,
        "gpu_utilization": None,
        "reads": 6,
    }


def test_without_its_config_the_agent_gets_no_advice() -> None:
    s = read(100, 1.0).model_copy(update={"config": None})
    assert evidence_from_reads([(0.0, s), (1.0, s)]) is None
    ctx = ActionContext(
        client=ScriptedAgent([s]),  # type: ignore[arg-type]
        state=s,
        dry_run=False,
        begin=lambda before, details: None,
        wait=lambda seconds: None,
    )
    outcome = advise_block_size(AdviseBlockSize(seconds=1), ctx)
    assert outcome.after == {
        "advice": "the agent does not report its config: no block size to advise from"
    }


# --- requests in the engine (the policy check's concurrency) --------------------------------


def test_requests_in_the_engine_at_once_and_on_average_over_the_window() -> None:
    stays = [
        (0.0, 4.0),  # began before the window (2..12): counts from 2
        (3.0, 5.0),
        (3.0, 20.0),  # still in the engine at the end
        (4.0, 4.0),  # a finish and an arrival at one instant: never 4 at once
        (0.0, 1.0),  # finished before the window: not counted
    ]
    peak, mean = requests_in_engine(stays, 2.0, 12.0)
    assert peak == 3
    assert mean == pytest.approx((2 + 2 + 9 + 0) / 10)
    assert requests_in_engine([], 0.0, 10.0) == (0, 0.0)

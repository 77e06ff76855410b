"""The `advise_block_size` action: the block size to restart with, by measurement.

The field reports go both ways: smaller blocks against fragmentation (16
over 32), larger ones when the cost of managing them dominates ("too small
blocks add management overhead"; exception 3: throughput down → a larger
block size). The action reads the engine's agent for a few seconds and
weighs what it measured (`vllm_runbook.rules.config_checks.block_size_direction`):

- the what-if fragmentation at every block size
  (`vllm_runbook_block_fragmentation_at_block_size`), averaged over the reads
  with requests running;
- schedule()'s share of the engine's time (`vllm_runbook_schedule_seconds`:
  its sum's increase over the time between two reads that both had requests
  running, when the engine steps back to back), and its cost per step;
- the GPU utilisation (NVML), where there is a GPU.

A block size needs a restart: this advises and changes nothing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Annotated, Final

from pydantic import Field
from vllm_runbook.collector.agent_api import AgentState
from vllm_runbook.rules.config_checks import (
    BlockSizeEvidence,
    block_size_direction,
    gpu_utilization_max,
    what_if_fragmentation,
)
from vllm_runbook.runbooks.engine.operations import ActionContext, ActionOutcome
from vllm_runbook.runbooks.model.actions import ActionParams, action

# One read of the agent a second over the measurement.
READ_INTERVAL_S: Final = 1.0


def evidence_from_reads(reads: Sequence[tuple[float, AgentState]]) -> BlockSizeEvidence | None:
    """What `reads` ((monotonic seconds, /v1/state), oldest first) measured; None
    when the agent does not report its config (no block size to start from)."""
    config = reads[-1][1].config
    if config is None:
        return None
    sums: dict[int, float] = {}
    running = 0
    for _, state in reads:
        what_if = what_if_fragmentation(state)
        if what_if:
            running += 1
            for size, ratio in what_if.items():
                sums[size] = sums.get(size, 0.0) + ratio
    fragmentation = {size: total / running for size, total in sums.items()}
    scheduled = elapsed = 0.0
    steps = 0
    for (t0, s0), (t1, s1) in pairwise(reads):
        if s0.stats.requests_running and s1.stats.requests_running and t1 > t0:
            scheduled += s1.schedule_histogram.sum_seconds - s0.schedule_histogram.sum_seconds
            elapsed += t1 - t0
            steps += s1.stats.steps_total - s0.stats.steps_total
    utilizations = [u for _, s in reads if (u := gpu_utilization_max(s)) is not None]
    return BlockSizeEvidence(
        block_size=config.block_size,
        platform=config.platform,
        fragmentation=fragmentation,
        schedule_share=scheduled / elapsed if elapsed > 0 and steps > 0 else None,
        schedule_seconds_per_step=scheduled / steps if steps > 0 else None,
        gpu_utilization=max(utilizations) if utilizations else None,
    )


class AdviseBlockSize(ActionParams):
    """Measure for `seconds`, then advise the block size to restart with: smaller when
    fragmentation wastes the KV slots, larger when schedule() takes the engine's time."""

    seconds: Annotated[float, Field(gt=0, le=60)] = 5.0


@action(mutating=False)
def advise_block_size(
    params: AdviseBlockSize, ctx: ActionContext, clock: Callable[[], float] = time.monotonic
) -> ActionOutcome:
    """The direction (smaller, larger, keep) with the figures it was chosen by."""
    reads = [(clock(), ctx.state)]
    count = max(1, math.ceil(params.seconds / READ_INTERVAL_S))
    for _ in range(count):
        ctx.wait(params.seconds / count)
        reads.append((clock(), ctx.client.state()))
    evidence = evidence_from_reads(reads)
    if evidence is None:
        text = "the agent does not report its config: no block size to advise from"
        return ActionOutcome(after={"advice": text})
    direction = block_size_direction(evidence)
    share, per_step = evidence.schedule_share, evidence.schedule_seconds_per_step
    measured = {
        "block_size": evidence.block_size,
        "fragmentation": {str(k): round(v, 4) for k, v in sorted(evidence.fragmentation.items())},
        "schedule_share": None if share is None else round(share, 4),
        "schedule_seconds_per_step": None if per_step is None else round(per_step, 6),
        "gpu_utilization": evidence.gpu_utilization,
        "reads": len(reads),
    }
    return ActionOutcome(
        after={
            "advice": direction.text,
            "direction": direction.direction,
            "restart_block_size": direction.block_size,
        },
        details={"measured": measured},
    )

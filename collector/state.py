"""The agent's `/v1/state` answer, built from the collector's parts.

Runs in the agent's HTTP thread, never in the scheduler's step: the parts
keep plain numbers, and the models of agent_api.py are built here, when
someone asks. The queues are read under the scheduler lock, the models built
after it is released.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any, Final, Protocol

from vllm_runbook.collector import metrics as M
from vllm_runbook.collector.agent_api import (
    AgentState,
    AutopilotState,
    Bound,
    Bounds,
    EngineConfig,
    EngineInfo,
    Gpus,
    Knobs,
    ParallelConfig,
    ScheduleHistogram,
    Stats,
    TierNow,
    Tiers,
    TierSettings,
    Workload,
)
from vllm_runbook.collector.autopilot import Autopilot
from vllm_runbook.collector.control import Bound as ControlBound
from vllm_runbook.collector.control import EngineControl
from vllm_runbook.collector.episode import EpisodeHistory, episode_span
from vllm_runbook.collector.exporter import Sample
from vllm_runbook.collector.nvml import NvmlPoller
from vllm_runbook.collector.queues import QueueInspector
from vllm_runbook.collector.request_tracking import ChangeTracker, RequestTracker
from vllm_runbook.collector.settings import CollectorSettings, EngineIdentity, vllm_version
from vllm_runbook.collector.stall import StallWatch
from vllm_runbook.collector.step_stats import StepStats

if TYPE_CHECKING:
    from vllm_runbook.collector.vllm_types import VllmScheduler


class StateSource(Protocol):
    """The collector's parts the state is built from (collector/engine_collector.py's
    EngineCollector wires them)."""

    settings: CollectorSettings
    scheduler: VllmScheduler  # vLLM's Scheduler (hooked)
    enabled: bool
    identity: EngineIdentity
    stats: StepStats
    requests: RequestTracker
    changes: ChangeTracker
    episode: EpisodeHistory
    autopilot: Autopilot
    control: EngineControl
    queues: QueueInspector
    stall: StallWatch
    nvml: NvmlPoller
    config: EngineConfig

    def state_samples(self) -> list[Sample]: ...


# The series whose quantity the rules and runbooks name without its unit or
# `num_` (rules/signals.py): on the wire, `stats` names them as the signals do.
SIGNAL_NAMES: Final[dict[M.MetricSpec, str]] = {
    M.ENGINE_START_TIME: "engine_start_time",
    M.BLOCK_FRAGMENTATION: "block_fragmentation",
    M.BUDGET_FILL: "budget_fill",
    M.REQUESTS_RUNNING: "requests_running",
    M.REQUESTS_WAITING: "requests_waiting",
    M.OLDEST_WAITING: "oldest_waiting",
    M.LAST_STEP_AGE: "last_step_age",
    M.KV_CACHE_USAGE: "kv_cache_usage",
    M.KV_CACHE_USAGE_PEAK: "kv_cache_usage_peak",
}

# Series name → its key in `stats`: the signal's name where rules and runbooks
# name the quantity, else the name without the prefix, counters with `_total`
# (the names Prometheus shows). Histograms, series with extra labels and
# NVML's (in `gpus`) are left out.
STAT_KEYS: Final[dict[str, str]] = {
    spec.name: SIGNAL_NAMES.get(spec)
    or spec.name.removeprefix(M.PREFIX) + ("_total" if spec.type == "counter" else "")
    for spec in M.ALL_METRICS
    if spec.type != "histogram"
    and not spec.extra_labels
    and spec not in M.NVML_METRICS
    and spec not in M.CONFIG_METRICS
}


def stats_values(samples: list[Sample]) -> dict[str, Any]:
    """{stat key: value} of the samples that have one (NaN: None)."""
    values: dict[str, Any] = {}
    for s in samples:
        key = STAT_KEYS.get(s.spec.name)
        if key is not None:
            values[key] = None if math.isnan(s.value) else s.value
    return values


def _bound(bound: ControlBound) -> Bound:
    return Bound(
        min=bound.minimum,
        max=bound.maximum,
        min_reason=bound.min_reason,
        max_reason=bound.max_reason,
    )


def build_state(
    c: StateSource, since_step: int | None = None, episode_seconds: float | None = None
) -> AgentState:
    """With `since_step` (the step a change took effect from, as the knob routes
    answer it), `since` holds what happened from that step on. `episode` holds the
    checks' gauges over `episode_seconds` (see episode_span: the window without it)."""
    window = c.settings.window_seconds
    stats = stats_values(c.state_samples())
    stats["preemptions_per_minute"] = c.stats.preemptions_per_minute()
    stats["admitted_before_time"] = c.requests.waiting_horizon()[1]
    stats["starving_waiting"] = len(c.requests.oldest_waiting())
    stats["stall_reason"] = c.stall.reason()
    stats["admitted_per_second"] = c.requests.admitted_per_second(window)
    stats.update(c.requests.window_summary(window))
    stats["window_seconds"] = window
    stats["requests_finished_by_reason_total"] = dict(c.requests.log.by_reason)
    stats["block_fragmentation_at_block_size"] = {
        str(size): ratio for size, ratio in c.stats.fragmentation_at_block_sizes()
    }
    control = c.control
    bounds = control.bounds()
    identity = c.identity
    histogram_bounds, cumulative, schedule_seconds = c.stats.schedule_histogram()
    max_num_seqs = int(c.scheduler.max_num_active_reqs)
    tiers = c.queues.tier_counts()
    return AgentState(
        engine=EngineInfo(
            model_name=identity.model_name,
            engine=str(identity.dp_rank),
            pid=os.getpid(),
            started_at=identity.start_time,
            step=c.stats.steps,
            vllm_version=vllm_version(),
            scheduler_class=type(c.scheduler).__name__,
            parallel=ParallelConfig(
                tensor_parallel_size=identity.tensor_parallel_size,
                pipeline_parallel_size=identity.pipeline_parallel_size,
                data_parallel_size=identity.data_parallel_size,
            ),
        ),
        collector_up=c.enabled,
        knobs=Knobs(**control.knobs()),
        startup=Knobs(**control.startup),
        bounds=Bounds(
            max_num_batched_tokens=_bound(bounds["max_num_batched_tokens"]),
            max_num_seqs=_bound(bounds["max_num_seqs"]),
        ),
        autopilot=AutopilotState.model_validate(
            {**c.autopilot.snapshot(), "ceiling": control.autopilot_ceiling()}
        ),
        stats=Stats(**stats),
        gpus=Gpus(**c.nvml.snapshot()),
        schedule_histogram=ScheduleHistogram(
            bounds=list(histogram_bounds),
            cumulative=cumulative,
            sum_seconds=schedule_seconds,
        ),
        since=None if since_step is None else c.changes.since(since_step),
        tiers=Tiers(
            config=TierSettings(**control.tiers.as_dict(max_num_seqs)),
            now=None
            if tiers is None
            else {
                tier: TierNow(
                    waiting=tiers.waiting[i],
                    running=tiers.running[i],
                    oldest_waiting_seconds=tiers.oldest_waiting_seconds[i],
                )
                for i, tier in enumerate(M.TIERS)
            },
        ),
        queues=c.queues.snapshot(),
        config=c.config,
        workload=Workload.model_validate(c.requests.workload(window)),
        episode=c.episode.episode(c.requests.clock(), episode_span(episode_seconds, window)),
    )

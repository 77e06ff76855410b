"""The gauges a runbook's checks read, kept over time: what an episode looked like.

A check read at one instant can land between two waves of a burst and show
zeros while the finding it answers fired. `EpisodeHistory` keeps, once a
second while the engine steps, the gauges the checks read (KV usage and
capacity, the queues, the longest sequence, fragmentation, budget fill,
the GPUs' busiest and fullest), and answers their peak and mean over a span
ending now (`/v1/state`'s `episode`).

The cost in the step is the breaker's tick the history rides on
(request_tracking.py's ChangeTracker.sample: one clock read per step): the
gauges are read only when that tick samples, at most once a second, as
plain attribute reads. The HTTP thread copies the samples and does the
arithmetic.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Final

from vllm_runbook.collector.agent_api import EPISODE_SIGNALS, Episode, Extent
from vllm_runbook.collector.request_tracking import HISTORY_INTERVAL_S, HISTORY_KEPT

if TYPE_CHECKING:
    from vllm_runbook.collector.request_tracking import RequestTracker
    from vllm_runbook.collector.step_stats import StepStats
    from vllm_runbook.collector.vllm_types import VllmScheduler

# The longest span answered: as far back as the samples reach on a busy engine.
EPISODE_KEPT_SECONDS: Final = HISTORY_KEPT * HISTORY_INTERVAL_S
_NAN: Final = math.nan
GpuReadings = Mapping[str, Mapping[str, float]]


def kv_capacity_seqs(used: int, free: int, running: int) -> int | None:
    """Sequences the KV cache holds at the running requests' current average footprint.

    floor(usable / (used / running)), in integers so a full cache gives
    exactly `running` (a float division can land on running - 1). None when
    nothing runs or holds blocks: there is no footprint to scale.
    """
    if not running or used <= 0:
        return None
    return max(1, (used + free) * running // used)


def episode_span(asked: float | None, window_seconds: float) -> float:
    """The span an episode is read over: the asked seconds, at least the collector's
    window (the span of a finding's condition), at most what the samples keep."""
    return min(max(asked or 0.0, window_seconds), EPISODE_KEPT_SECONDS)


class EpisodeHistory:
    """One-second samples of the checks' gauges (engine thread writes, any thread reads)."""

    def __init__(
        self,
        scheduler: VllmScheduler,
        stats: StepStats,
        requests: RequestTracker,
        gpus: Callable[[], GpuReadings] = dict,
        kept: int = HISTORY_KEPT,
    ) -> None:
        self.scheduler = scheduler
        self.stats = stats
        self.requests = requests
        self.gpus = gpus
        # (time, one value per EPISODE_SIGNALS; NaN: not defined then), oldest first.
        self.samples: deque[tuple[float, ...]] = deque(maxlen=kept)

    def sample(self, now: float) -> None:
        """After a step the breaker's tick sampled at (engine thread)."""
        stats, scheduler = self.stats, self.scheduler
        usable = stats.usable_blocks
        free = stats.block_pool.get_num_free_blocks()
        used = usable - free
        running = len(scheduler.running)
        since = self.requests.oldest_waiting_since
        capacity = kv_capacity_seqs(used, free, running)
        gpus = self.gpus()
        longest, fragmentation, length_padding = stats.batch_gauges()
        if self.samples and now < self.samples[-1][0]:
            self.samples.clear()  # a wall clock set back: the samples stay in time order
        self.samples.append(
            (
                now,
                used / usable if usable else 0.0,
                _NAN if capacity is None else float(capacity),
                float(running),
                float(len(scheduler.waiting) + len(scheduler.kv_holding_waiting)),
                0.0 if since is None else max(0.0, now - since),
                float(longest),
                fragmentation,
                stats.budget_fill,
                length_padding,
                max((g["utilization_ratio"] for g in gpus.values()), default=_NAN),
                max((g["memory_used_bytes"] for g in gpus.values()), default=_NAN),
            )
        )

    def episode(self, now: float, seconds: float) -> Episode:
        """Peak and mean of each gauge over the `seconds` before `now` (any thread)."""
        samples = list(self.samples)
        kept = max(0.0, now - samples[0][0]) if samples else 0.0
        start = bisect.bisect_left(samples, now - seconds, key=_time)
        window = samples[start:]
        extents: dict[str, Extent] = {}
        for index, name in enumerate(_COLUMNS, start=1):
            values = [s[index] for s in window if not math.isnan(s[index])]
            if values:
                extents[name] = Extent(peak=max(values), mean=math.fsum(values) / len(values))
        return Episode(seconds=seconds, kept_seconds=kept, samples=len(window), **extents)


def _time(sample: tuple[float, ...]) -> float:
    return sample[0]


# The columns of a sample after its time, as `sample` appends them: the wire's fields.
_COLUMNS: Final = (
    "kv_cache_usage",
    "kv_capacity_seqs",
    "requests_running",
    "requests_waiting",
    "oldest_waiting",
    "max_sequence_tokens",
    "block_fragmentation",
    "budget_fill",
    "length_padding_ratio",
    "gpu_utilization_max",
    "gpu_memory_used_max",
)
assert _COLUMNS == EPISODE_SIGNALS, (_COLUMNS, EPISODE_SIGNALS)

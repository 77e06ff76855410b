"""Per-step statistics of one scheduler: tokens, budget, preemptions, prefix
cache, padding, block fragmentation, KV usage and the cost of schedule().

`StepStats` reads its data source, the scheduler (its KV cache manager and
block pool, its queues), after each step in the engine thread: plain
arithmetic on plain attributes, nothing else. `samples()` turns the numbers
into Prometheus samples for whoever scrapes, on the scraping thread.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import repeat
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from vllm_runbook.collector import metrics as M
from vllm_runbook.collector.exporter import Sample
from vllm_runbook.collector.token_sums import RunningTokenSums
from vllm_runbook.collector.window import (
    QueuedHistogram,
    SlidingWindowMax,
    SlidingWindowRatio,
)

if TYPE_CHECKING:
    from vllm_runbook.collector.vllm_types import KVCacheBlock, VllmScheduler

_request_id = attrgetter("request_id")


def predicted_padded_tokens(num_tokens: int, capture_sizes: list[int]) -> int:
    """Tokens the model runner executes for a batch of `num_tokens` when it pads
    to the smallest cudagraph capture size ≥ n (eager above the largest)."""
    if not capture_sizes or num_tokens > capture_sizes[-1] or num_tokens <= 0:
        return num_tokens
    return capture_sizes[bisect.bisect_left(capture_sizes, num_tokens)]


def _count_real_blocks(blocks: Sequence[KVCacheBlock]) -> int:
    return sum(1 for b in blocks if not b.is_null)


class StepStats:
    """The scheduler's per-step numbers; written by the engine thread only."""

    def __init__(self, scheduler: VllmScheduler, window_seconds: float) -> None:
        self.scheduler = scheduler
        self.block_size = int(scheduler.block_size)
        # KV blocks: the first KV cache group (full attention for decoder LLMs).
        kv_manager = scheduler.kv_cache_manager
        self.block_pool = kv_manager.block_pool
        group0 = kv_manager.coordinator.single_type_managers[0]
        self._req_to_blocks: Mapping[str, Sequence[KVCacheBlock]] = group0.req_to_blocks
        # Only full attention never holds null placeholder blocks; other kinds
        # (sliding window, mamba) need the slower count.
        from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

        self._blocks_have_nulls = type(group0) is not FullAttentionManager
        self._usable_blocks = self.block_pool.num_gpu_blocks - 1  # minus vLLM's null block
        # Resumed requests: among the cached ones up to vLLM 0.33, the new ones in 0.34.
        from vllm_runbook.collector.adapters.resumed_requests import resumed_ids_reader

        self._resumed_ids = resumed_ids_reader()

        compilation = scheduler.vllm_config.compilation_config
        mode = compilation.cudagraph_mode
        cudagraphs_on = mode is not None and getattr(mode, "name", str(mode)) != "NONE"
        self.capture_sizes = (
            sorted(compilation.cudagraph_capture_sizes or []) if cudagraphs_on else []
        )

        self.steps = 0
        self.scheduled_tokens = 0
        self.token_budget = 0
        self.step_tokens = 0
        self.budget_fill = 0.0
        self.preemptions = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.padded_tokens = 0
        self.unpadded_tokens = 0
        self.fragmentation = 0.0
        self.length_padding = 0.0
        # The heartbeat (collector/stall.py reads these from other threads):
        # time.monotonic() of the latest schedule() and update_from_output(),
        # of the latest step that admitted a request and that left the queue
        # empty; update_from_output() calls; the usual schedule-to-update time.
        self.scheduled_at = self.updated_at = 0.0
        self.admitted_at = self.queue_empty_at = 0.0
        self.updates = 0
        self.step_seconds_usual = 0.0
        # The what-if sizes, then the engine's own if it is not one of them.
        self.what_if_sizes = M.WHAT_IF_BLOCK_SIZES
        sizes = self.what_if_sizes + (
            () if self.block_size in self.what_if_sizes else (self.block_size,)
        )
        self._own_size_index = sizes.index(self.block_size)
        self.running_sums = RunningTokenSums(sizes)
        self._no_sums: tuple[int, tuple[int, ...]] = (0, (0,) * len(sizes))
        # (Σ tokens, Σ blocks per size) after the latest step, as one tuple.
        self.fragmentation_sums = self._no_sums
        # Full attention without lookahead slots holds exactly ceil(tokens / block
        # size) blocks per request after schedule(): the real fragmentation is the
        # sums' at the own size. Otherwise (sliding window, speculative decoding)
        # the block tables are read.
        self._blocks_are_ceil = (
            not self._blocks_have_nulls and int(getattr(scheduler, "num_lookahead_tokens", 0)) == 0
        )
        # Longest context (computed tokens, prompt + generated) in the running batch.
        self.max_sequence_tokens = 0
        # (steps, preemptions, scheduled tokens) after the latest step, as one tuple.
        self.progress = (0, 0, 0)
        # schedule()'s wall time: the step only queues it; the reader files it.
        self.schedule_seconds = QueuedHistogram(M.SCHEDULE_SECONDS.buckets)
        self._schedule_queue = self.schedule_seconds.queue
        self._schedule_limit = self.schedule_seconds.limit
        self.window_seconds = window_seconds
        self.hit_window = SlidingWindowRatio(window_seconds)
        self._windowed_lookups = (0, 0)  # (queries, hits) the hit window holds so far
        self.padding_window = SlidingWindowRatio(window_seconds)
        self.preemption_window = SlidingWindowRatio(window_seconds)
        self.kv_usage_peak = SlidingWindowMax(window_seconds)

    @property
    def usable_blocks(self) -> int:
        """KV blocks requests can hold (vLLM's null block excluded)."""
        return self._usable_blocks

    def kv_usage(self, free_blocks: int) -> float:
        usable = self._usable_blocks
        return 1.0 - free_blocks / usable if usable else 0.0

    def preemptions_per_minute(self) -> float:
        """Over the trailing window (any thread)."""
        preempted, _ = self.preemption_window.sums()
        return preempted * 60.0 / self.window_seconds

    def schedule_histogram(self) -> tuple[tuple[float, ...], list[int], float]:
        """(bounds, cumulative counts with +Inf last, sum of seconds) of
        schedule()'s wall time, every step so far (any thread)."""
        histogram = self.schedule_seconds
        cumulative, total = histogram.read()
        return histogram.bounds, cumulative, total

    # -- per step (engine thread): plain arithmetic only ---------------------

    def on_prefix_lookup(self, num_tokens: int, num_hits: int) -> None:
        """One request's lookup at its admission (inside schedule()): two sums. The
        hit window gets the step's lookups at once, in on_schedule."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hits

    def on_schedule(
        self, scheduler: VllmScheduler, output: Any, elapsed: float, free_before: int
    ) -> None:
        """After schedule(): `request.num_computed_tokens` includes this step.
        `free_before`: free KV blocks when schedule() started."""
        self.scheduled_at = now = time.monotonic()  # the windows' clock too
        if self._usable_blocks:
            self.kv_usage_peak.add(1.0 - free_before / self._usable_blocks, now)
        queries, hits = self.prefix_queries, self.prefix_hits
        windowed_queries, windowed_hits = self._windowed_lookups
        if queries != windowed_queries or hits != windowed_hits:  # this step's lookups
            self.hit_window.add(hits - windowed_hits, queries - windowed_queries, now)
            self._windowed_lookups = (queries, hits)
        queued = self._schedule_queue  # QueuedHistogram.add, inline
        queued.append(elapsed)
        if len(queued) >= self._schedule_limit:  # nobody read it for that long
            self.schedule_seconds.file()
        tokens = output.total_num_scheduled_tokens
        budget = scheduler.max_num_scheduled_tokens
        if output.scheduled_new_reqs:
            self.admitted_at = now
        if not len(scheduler.waiting) and not len(scheduler.kv_holding_waiting):
            self.queue_empty_at = now
        self.steps += 1
        self.scheduled_tokens += tokens
        self.token_budget += budget
        self.step_tokens = tokens
        self.budget_fill = tokens / budget if budget else 0.0
        preempted = len(output.preempted_req_ids)
        if preempted:
            self.preemptions += preempted
            self.preemption_window.add(preempted, 0, now)
        # One consistent triple for readers on other threads (one assignment).
        self.progress = (self.steps, self.preemptions, self.scheduled_tokens)

        running = scheduler.running
        sums = self.running_sums
        if not running:
            if len(sums):
                sums.clear()
            self.fragmentation = self.length_padding = 0.0
            self.max_sequence_tokens = 0
            self.fragmentation_sums = self._no_sums
            return
        # Incremental: only the requests whose token count changed other than by
        # one decoded token are read (token_sums.py); a pure decode step is O(1).
        for request_id in output.preempted_req_ids:
            sums.discard(request_id)
        requests = scheduler.requests
        scheduled = output.num_scheduled_tokens
        new_reqs = output.scheduled_new_reqs
        cached = output.scheduled_cached_reqs
        cached_ids = cached.req_ids
        new_tokens = sum(scheduled[r.req_id] for r in new_reqs) if new_reqs else 0
        if not self._resumed_ids(cached) and len(cached_ids) == len(sums):
            sums.advance_all()  # every running request one token on (a decode)
            if tokens - new_tokens != len(cached_ids):
                # A step with prefill chunks (or draft tokens): the few requests
                # that did not take exactly one token are read; re-reading them
                # all cost 2.4 µs per running request in every such step.
                for request_id in cached_ids:
                    if scheduled[request_id] != 1:
                        sums.set(request_id, requests[request_id].num_computed_tokens)
        else:
            for request_id in cached_ids:
                sums.set(request_id, requests[request_id].num_computed_tokens)
        for r in new_reqs:
            sums.set(r.req_id, requests[r.req_id].num_computed_tokens)
        if len(sums) != len(running):  # a request left or came unseen: recount
            sums.reset((r.request_id, r.num_computed_tokens) for r in running)
        computed = sums.tokens()
        self.max_sequence_tokens = sums.max_tokens()
        self.fragmentation_sums = (computed, tuple(sums.blocks))
        if self._blocks_are_ceil:
            held = sums.blocks[self._own_size_index]
        else:
            ids = list(map(_request_id, running))
            blocks: Iterator[Sequence[KVCacheBlock]] = map(
                self._req_to_blocks.get, ids, repeat([], len(ids))
            )
            count: Callable[[Sequence[KVCacheBlock]], int] = (
                _count_real_blocks if self._blocks_have_nulls else len
            )
            held = sum(map(count, blocks))
        self.fragmentation = 1.0 - computed / (held * self.block_size) if held else 0.0
        if len(scheduled) == len(running):  # scheduled ⊆ running after schedule()
            max_len = self.max_sequence_tokens
            count_scheduled = len(running)
        else:
            lengths = [requests[i].num_computed_tokens for i in scheduled]
            computed, max_len, count_scheduled = sum(lengths), max(lengths, default=0), len(lengths)
        self.length_padding = 1.0 - computed / (count_scheduled * max_len) if max_len else 0.0

    def on_request_freed(self, request_id: str) -> None:
        """A request finished or was aborted: it leaves the running sums."""
        self.running_sums.discard(request_id)

    def fragmentation_at_block_sizes(self) -> list[tuple[int, float]]:
        """(block size, what-if fragmentation) after the latest step (any thread)."""
        computed, blocks = self.fragmentation_sums
        return [
            (b, 1.0 - computed / (n * b) if n else 0.0)
            for b, n in zip(self.what_if_sizes, blocks, strict=False)
        ]

    def on_update(
        self, scheduler: VllmScheduler, scheduler_output: Any, runner_output: Any
    ) -> None:
        """After update_from_output(): padding of the batch just executed."""
        self.updated_at = now = time.monotonic()
        self.updates += 1
        # An exponential average (about the last 20 steps) of schedule-to-update time.
        self.step_seconds_usual += 0.05 * (now - self.scheduled_at - self.step_seconds_usual)
        stat = runner_output.cudagraph_stats
        if stat is not None:
            unpadded, padded = stat.num_unpadded_tokens, stat.num_padded_tokens
        else:
            unpadded = scheduler_output.total_num_scheduled_tokens
            sizes = self.capture_sizes  # none captured (eager, CPU): no padding
            padded = predicted_padded_tokens(unpadded, sizes) if sizes else unpadded
        if padded:
            self.padded_tokens += padded
            self.unpadded_tokens += unpadded
            self.padding_window.add(padded - unpadded, padded, now)
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        if spec_tokens:  # rejected draft tokens were taken back from num_computed_tokens
            requests, sums = scheduler.requests, self.running_sums
            for request_id in spec_tokens:
                request = requests.get(request_id)
                if request is not None and request_id in sums.keys:
                    sums.set(request_id, request.num_computed_tokens)
        if not scheduler.running:
            # The batch is gone: no step follows until a request arrives, so the
            # latest-step gauges would otherwise keep the last batch's shape (an
            # idle engine read as padded for as long as it stays idle).
            self.fragmentation = self.length_padding = 0.0
            self.max_sequence_tokens = 0
            self.fragmentation_sums = self._no_sums

    # -- at scrape time (any thread) -------------------------------------------

    def samples(self) -> list[Sample]:
        """Reads the scheduler's ints and list lengths from another thread:
        single attribute reads, no iteration."""
        sched = self.scheduler
        usable = self._usable_blocks
        free = self.block_pool.get_num_free_blocks()
        _, cumulative, schedule_seconds = self.schedule_histogram()
        return [
            Sample(M.PREFIX_CACHE_QUERIES, self.prefix_queries),
            Sample(M.PREFIX_CACHE_HITS, self.prefix_hits),
            # No lookups in the window: undefined (NaN), not "0 % hits".
            Sample(M.KV_HIT_RATIO, self.hit_window.ratio(math.nan)),
            Sample(M.BLOCK_FRAGMENTATION, self.fragmentation),
            *(
                Sample(M.BLOCK_FRAGMENTATION_AT, ratio, (str(size),))
                for size, ratio in self.fragmentation_at_block_sizes()
            ),
            Sample(M.PADDING_RATIO, self.padding_window.ratio()),
            Sample(M.LENGTH_PADDING_RATIO, self.length_padding),
            Sample(M.SCHEDULE_SECONDS, schedule_seconds, buckets=tuple(cumulative)),
            Sample(M.STEPS, self.steps),
            Sample(M.SCHEDULED_TOKENS, self.scheduled_tokens),
            Sample(M.TOKEN_BUDGET, self.token_budget),
            Sample(M.STEP_TOKENS, self.step_tokens),
            Sample(M.BUDGET_FILL, self.budget_fill),
            Sample(M.PADDED_TOKENS, self.padded_tokens),
            Sample(M.UNPADDED_TOKENS, self.unpadded_tokens),
            Sample(M.REQUESTS_RUNNING, len(sched.running)),
            Sample(M.REQUESTS_WAITING, len(sched.waiting) + len(sched.kv_holding_waiting)),
            Sample(M.PREEMPTIONS, self.preemptions),
            Sample(M.MAX_SEQUENCE_TOKENS, self.max_sequence_tokens),
            Sample(M.KV_BLOCKS_USED, usable - free),
            Sample(M.KV_BLOCKS_FREE, free),
            Sample(M.KV_CACHE_USAGE, (usable - free) / usable if usable else 0.0),
            Sample(M.KV_CACHE_USAGE_PEAK, self.kv_usage_peak.max()),
        ]

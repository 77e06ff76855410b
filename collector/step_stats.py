"""Per-step statistics of one scheduler: tokens, budget, preemptions, prefix
cache, padding, block fragmentation, KV usage and the cost of schedule().

`StepStats` reads its data source, the scheduler (its KV cache manager and
block pool, its queues), after each step in the engine thread: plain
arithmetic on plain attributes, nothing else, and as few objects as it can
(the step's counters are one tuple, the running requests' lengths one dict
and a shift). What can be derived is derived when read: the fragmentation
and padding gauges from the lengths (`shape()`), the fill from the counters.
`samples()` turns the numbers into Prometheus samples for whoever scrapes,
on the scraping thread.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from itertools import repeat
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from vllm_runbook.collector import metrics as M
from vllm_runbook.collector.exporter import Sample
from vllm_runbook.collector.token_sums import RunningTokenSums, totals
from vllm_runbook.collector.window import (
    NO_SECOND,
    QueuedHistogram,
    SlidingWindowMax,
    SlidingWindowRatio,
)

if TYPE_CHECKING:
    from vllm_runbook.collector.vllm_types import KVCacheBlock, VllmScheduler

_request_id = attrgetter("request_id")
_COPY_TRIES = 100  # shape(): tries to copy the running sums between two steps

# The running batch after a step: (Σ computed tokens, Σ blocks per size (the
# what-if sizes, then the engine's own if not one of them), KV blocks held,
# longest context, then the scheduled requests' Σ tokens, count and longest
# for the length padding).
_Shape = tuple[int, tuple[int, ...], int, int, int, int, int]
# What a step could not leave to the reader, or None: the KV blocks held where
# they are not ceil(tokens / block size), the scheduled requests' (Σ tokens,
# count, longest) where not every running request was scheduled.
_StepExtras = tuple[int | None, tuple[int, int, int] | None]
_NO_EXTRAS: _StepExtras = (None, None)


def predicted_padded_tokens(num_tokens: int, capture_sizes: list[int]) -> int:
    """Tokens the model runner executes for a batch of `num_tokens` when it pads
    to the smallest cudagraph capture size ≥ n (eager above the largest)."""
    if not capture_sizes or num_tokens > capture_sizes[-1] or num_tokens <= 0:
        return num_tokens
    return capture_sizes[bisect.bisect_left(capture_sizes, num_tokens)]


def _free_blocks_reader(block_pool: Any) -> Callable[[], int]:
    """`block_pool.get_num_free_blocks`, or the same counter read without a
    Python frame where that method only returns it (vLLM 0.32's BlockPool)."""
    getter: Callable[[], int] = block_pool.get_num_free_blocks
    try:
        from vllm.v1.core.block_pool import BlockPool

        read = partial(attrgetter("free_block_queue.num_free_blocks"), block_pool)
        plain = type(block_pool).get_num_free_blocks is BlockPool.get_num_free_blocks
        if plain and type(read()) is int and read() == getter():
            return read
    except Exception:  # another layout: the method
        pass
    return getter


def fragmentation_of(shape: _Shape, block_size: int) -> float:
    computed, _, held, *_ = shape
    return 1.0 - computed / (held * block_size) if held else 0.0


def length_padding_of(shape: _Shape) -> float:
    *_, computed, count, longest = shape
    return 1.0 - computed / (count * longest) if longest else 0.0


def _count_real_blocks(blocks: Sequence[KVCacheBlock]) -> int:
    return sum(1 for b in blocks if not b.is_null)


class StepStats:
    """The scheduler's per-step numbers; written by the engine thread only."""

    # Slots: the step reads and writes a dozen of these, cold in the CPU's
    # caches after the forward pass; a slot is one word at a fixed place in
    # the object, where an attribute of an instance dict with more names than
    # CPython shares between instances is a probe of a hash table (measured
    # on a real engine: about 1.9 µs less a decode step). `__dict__` for
    # whatever a test or benchmark puts on the instance.
    __slots__ = (
        "__dict__",
        "_blocks_are_ceil",
        "_blocks_have_nulls",
        "_counts",
        "_lookups_pending",
        "_no_shape",
        "_own_size_index",
        "_padding_possible",
        "_peak_free",
        "_peak_second",
        "_req_to_blocks",
        "_resumed_ids",
        "_schedule_limit",
        "_schedule_queue",
        "_step_extras",
        "_sums_busy",
        "_usable_blocks",
        "_windowed_lookups",
        "admitted_at",
        "block_pool",
        "block_size",
        "capture_sizes",
        "free_blocks",
        "hit_window",
        "kv_usage_peak",
        "padded_tokens",
        "padding_window",
        "preemption_window",
        "prefix_hits",
        "prefix_queries",
        "queue_empty_at",
        "running_sums",
        "schedule_seconds",
        "scheduled_at",
        "scheduler",
        "step_seconds_usual",
        "unpadded_tokens",
        "updated_at",
        "updates",
        "what_if_sizes",
        "window_seconds",
    )

    def __init__(self, scheduler: VllmScheduler, window_seconds: float) -> None:
        self.scheduler = scheduler
        self.block_size = int(scheduler.block_size)
        # KV blocks: the first KV cache group (full attention for decoder LLMs).
        kv_manager = scheduler.kv_cache_manager
        self.block_pool = kv_manager.block_pool
        # Free KV blocks now, read by the hook before each schedule(): the pool's
        # counter through C calls where vLLM's getter is the plain one.
        self.free_blocks: Callable[[], int] = _free_blocks_reader(self.block_pool)
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

        # (steps, preemptions, scheduled tokens, Σ token budget, this step's
        # tokens, its budget) after the latest step: one tuple the engine thread
        # replaces whole each step (readers on other threads see one step's).
        self._counts: tuple[int, int, int, int, int, int] = (0, 0, 0, 0, 0, 0)
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.padded_tokens = 0
        self.unpadded_tokens = 0
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
        self._step_extras = _NO_EXTRAS
        # True while on_schedule changes the running sums: a reader on another
        # thread copies them between two steps (shape()).
        self._sums_busy = False
        # The running batch with no request (see _Shape):
        # the fragmentation and padding gauges are derived from it when read.
        self._no_shape: _Shape = (0, (0,) * len(sizes), 0, 0, 0, 0, 0)
        # Full attention without lookahead slots holds exactly ceil(tokens / block
        # size) blocks per request after schedule(): the real fragmentation is the
        # sums' at the own size. Otherwise (sliding window, speculative decoding)
        # the block tables are read.
        self._blocks_are_ceil = (
            not self._blocks_have_nulls and int(getattr(scheduler, "num_lookahead_tokens", 0)) == 0
        )
        # schedule()'s wall time: the step only queues it; the reader files it.
        self.schedule_seconds = QueuedHistogram(M.SCHEDULE_SECONDS.buckets)
        self._schedule_queue = self.schedule_seconds.queue
        self._schedule_limit = self.schedule_seconds.limit
        self.window_seconds = window_seconds
        self.hit_window = SlidingWindowRatio(window_seconds)
        self._windowed_lookups = (0, 0)  # (queries, hits) the hit window holds so far
        self._lookups_pending = False  # lookups since the hit window's last
        self.padding_window = SlidingWindowRatio(window_seconds)
        # Without cudagraphs (eager, CPU) no step is padded: the window stays empty.
        self._padding_possible = bool(self.capture_sizes)
        self.preemption_window = SlidingWindowRatio(window_seconds)
        self.kv_usage_peak = SlidingWindowMax(window_seconds)
        # The second of the latest step and the fewest free KV blocks in it.
        self._peak_second = NO_SECOND
        self._peak_free = 0

    # -- the latest step, as readers see it (any thread) -----------------------

    @property
    def steps(self) -> int:
        return self._counts[0]

    @property
    def preemptions(self) -> int:
        return self._counts[1]

    @property
    def scheduled_tokens(self) -> int:
        return self._counts[2]

    @property
    def progress(self) -> tuple[int, int, int]:
        """(steps, preemptions, scheduled tokens), of one step."""
        steps, preemptions, scheduled, *_ = self._counts
        return steps, preemptions, scheduled

    @property
    def token_budget(self) -> int:
        """Σ over the steps of the token budget each step had."""
        return self._counts[3]

    @property
    def step_tokens(self) -> int:
        return self._counts[4]

    @property
    def budget_fill(self) -> float:
        _, _, _, _, tokens, budget = self._counts
        return tokens / budget if budget else 0.0

    def shape(self) -> _Shape:
        """The running batch after the latest step (see _Shape), computed from
        the running sums (any thread: another copies them between two steps).
        O(requests × block sizes): read it once per use."""
        sums = self.running_sums
        for _ in range(_COPY_TRIES):
            counts, busy = self._counts, self._sums_busy
            shift, keys, extras = sums.shift, list(sums.keys.values()), self._step_extras
            if not busy and not self._sums_busy and counts is self._counts:
                break  # no step changed them meanwhile
            time.sleep(0)  # the engine thread is inside a step: let it finish
        if not keys:
            return self._no_shape
        computed, blocks, longest = totals(keys, shift, sums.sizes)
        held, scheduled = extras
        if held is None:
            held = blocks[self._own_size_index]
        if scheduled is None:
            scheduled = (computed, len(keys), longest)
        return (computed, blocks, held, longest, *scheduled)

    def batch_gauges(self) -> tuple[int, float, float]:
        """(longest sequence, fragmentation, length padding), from one shape."""
        shape = self.shape()
        return shape[3], fragmentation_of(shape, self.block_size), length_padding_of(shape)

    @property
    def fragmentation_sums(self) -> tuple[int, tuple[int, ...]]:
        """(Σ tokens, Σ blocks per size) over the running requests."""
        shape = self.shape()
        return shape[0], shape[1]

    @property
    def fragmentation(self) -> float:
        return fragmentation_of(self.shape(), self.block_size)

    @property
    def max_sequence_tokens(self) -> int:
        """Longest context (computed tokens, prompt + generated) in the running batch."""
        return self.shape()[3]

    @property
    def length_padding(self) -> float:
        return length_padding_of(self.shape())

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
        self._lookups_pending = True
        self.prefix_hits += num_hits

    def on_schedule(
        self, scheduler: VllmScheduler, output: Any, elapsed: float, free_before: int, now: float
    ) -> None:
        """After schedule(): `request.num_computed_tokens` includes this step.
        `free_before`: free KV blocks when schedule() started; `now`: the
        step's time.monotonic() (the heartbeat's and the windows' clock). Its
        data are out of the CPU's caches after the model's forward pass: every
        object read or written here costs, so the step's numbers are stored as
        two tuples and the gauges derived from them when read."""
        self.scheduled_at = now
        # The KV-usage peak: the window is told only in a new second or when
        # fewer blocks are free than this second's fewest so far (two ints of
        # this object; reading the window's newest second cost ~0.6 µs a step).
        second = int(now)
        if free_before < self._peak_free or second != self._peak_second:
            usable = self._usable_blocks
            if usable:
                self.kv_usage_peak.add(1.0 - free_before / usable, now)
            self._peak_free, self._peak_second = free_before, second
        if self._lookups_pending:  # this step admitted requests: its lookups
            self._lookups_pending = False
            queries, hits = self.prefix_queries, self.prefix_hits
            windowed_queries, windowed_hits = self._windowed_lookups
            self.hit_window.add(hits - windowed_hits, queries - windowed_queries, now)
            self._windowed_lookups = (queries, hits)
        queued = self._schedule_queue  # QueuedHistogram.add, inline
        queued.append(elapsed)
        if len(queued) >= self._schedule_limit:  # nobody read it for that long
            self.schedule_seconds.file()
        tokens = output.total_num_scheduled_tokens
        budget = scheduler.max_num_scheduled_tokens
        new_reqs = output.scheduled_new_reqs
        if new_reqs:
            self.admitted_at = now
        running = scheduler.running
        requests = scheduler.requests  # every unfinished request, each in one queue
        if len(requests) == len(running) or (
            not len(scheduler.waiting) and not len(scheduler.kv_holding_waiting)
        ):  # (the queues' own len() is a Python call each)
            self.queue_empty_at = now
        steps, preemptions, scheduled_tokens, token_budget, _, _ = self._counts
        preempted_ids = output.preempted_req_ids
        if preempted_ids:
            preemptions += len(preempted_ids)
            self.preemption_window.add(len(preempted_ids), 0, now)
        counts = (
            steps + 1,
            preemptions,
            scheduled_tokens + tokens,
            token_budget + budget,
            tokens,
            budget,
        )

        sums = self.running_sums
        if not running:
            if sums.keys:
                sums.clear()
            self._step_extras = _NO_EXTRAS
            self._counts = counts
            return
        # Only the requests whose token count changed other than by one decoded
        # token are read; a pure decode step only moves the shared shift.
        self._sums_busy = True
        try:
            if preempted_ids:
                for request_id in preempted_ids:
                    sums.discard(request_id)
            scheduled = output.num_scheduled_tokens
            cached = output.scheduled_cached_reqs
            cached_ids = cached.req_ids
            keys = sums.keys
            if not self._resumed_ids(cached) and len(cached_ids) == len(keys):
                sums.shift += 1  # every running request one token on (a decode)
                new_tokens = sum(scheduled[r.req_id] for r in new_reqs) if new_reqs else 0
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
            if new_reqs:
                for r in new_reqs:
                    sums.set(r.req_id, requests[r.req_id].num_computed_tokens)
            count = len(running)
            if len(sums.keys) != count:  # a request left or came unseen: recount
                sums.reset((r.request_id, r.num_computed_tokens) for r in running)
            if self._blocks_are_ceil and len(scheduled) == count:  # scheduled ⊆ running
                self._step_extras = _NO_EXTRAS
            else:
                self._step_extras = (
                    self._held_blocks(running),
                    self._scheduled_lengths(scheduled, count),
                )
        finally:
            self._counts = counts
            self._sums_busy = False

    def _held_blocks(self, running: Sequence[Any]) -> int | None:
        """KV blocks the running requests hold, from the block tables; None
        where that is ceil(tokens / block size) per request."""
        if self._blocks_are_ceil:
            return None
        ids = list(map(_request_id, running))
        block_lists: Iterator[Sequence[KVCacheBlock]] = map(
            self._req_to_blocks.get, ids, repeat([], len(ids))
        )
        count_blocks: Callable[[Sequence[KVCacheBlock]], int] = (
            _count_real_blocks if self._blocks_have_nulls else len
        )
        return sum(map(count_blocks, block_lists))

    def _scheduled_lengths(
        self, scheduled: Mapping[str, int], running: int
    ) -> tuple[int, int, int] | None:
        """(Σ tokens, count, longest) of the scheduled requests; None where
        every running request was scheduled."""
        if len(scheduled) == running:
            return None
        requests = self.scheduler.requests
        lengths = [requests[i].num_computed_tokens for i in scheduled]
        return sum(lengths), len(lengths), max(lengths, default=0)

    def on_request_freed(self, request_id: str) -> None:
        """A request finished or was aborted: it leaves the running sums."""
        self.running_sums.discard(request_id)

    def fragmentation_at_block_sizes(self, shape: _Shape | None = None) -> list[tuple[int, float]]:
        """(block size, what-if fragmentation) after the latest step (any thread)."""
        computed, blocks, *_ = self.shape() if shape is None else shape
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
            windowed = True
        else:
            unpadded = padded = scheduler_output.total_num_scheduled_tokens
            windowed = self._padding_possible  # else the ratio is 0 with or without it
            if windowed:
                padded = predicted_padded_tokens(unpadded, self.capture_sizes)
        if padded:
            self.padded_tokens += padded
            self.unpadded_tokens += unpadded
            if windowed:
                self.padding_window.add(padded - unpadded, padded, now)
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        if spec_tokens:  # rejected draft tokens were taken back from num_computed_tokens
            requests, sums = scheduler.requests, self.running_sums
            for request_id in spec_tokens:
                request = requests.get(request_id)
                if request is not None and request_id in sums.keys:
                    sums.set(request_id, request.num_computed_tokens)
        if not scheduler.running and self.running_sums.keys:
            # The batch is gone: no step follows until a request arrives, so the
            # latest-step gauges would otherwise keep the last batch's shape (an
            # idle engine read as padded for as long as it stays idle).
            self.running_sums.clear()
            self._step_extras = _NO_EXTRAS

    # -- at scrape time (any thread) -------------------------------------------

    def samples(self) -> list[Sample]:
        """Reads the scheduler's ints and list lengths from another thread:
        single attribute reads, no iteration."""
        sched = self.scheduler
        usable = self._usable_blocks
        free = self.block_pool.get_num_free_blocks()
        _, cumulative, schedule_seconds = self.schedule_histogram()
        shape = self.shape()
        return [
            Sample(M.PREFIX_CACHE_QUERIES, self.prefix_queries),
            Sample(M.PREFIX_CACHE_HITS, self.prefix_hits),
            # No lookups in the window: undefined (NaN), not "0 % hits".
            Sample(M.KV_HIT_RATIO, self.hit_window.ratio(math.nan)),
            Sample(M.BLOCK_FRAGMENTATION, fragmentation_of(shape, self.block_size)),
            *(
                Sample(M.BLOCK_FRAGMENTATION_AT, ratio, (str(size),))
                for size, ratio in self.fragmentation_at_block_sizes(shape)
            ),
            Sample(M.PADDING_RATIO, self.padding_window.ratio()),
            Sample(M.LENGTH_PADDING_RATIO, length_padding_of(shape)),
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
            Sample(M.MAX_SEQUENCE_TOKENS, shape[3]),
            Sample(M.KV_BLOCKS_USED, usable - free),
            Sample(M.KV_BLOCKS_FREE, free),
            Sample(M.KV_CACHE_USAGE, (usable - free) / usable if usable else 0.0),
            Sample(M.KV_CACHE_USAGE_PEAK, self.kv_usage_peak.max()),
        ]

"""Request tracking: arrivals, first schedules, finished requests, and what
happened after a change (what a verification reads).

`RequestTracker` follows each request from its arrival in the engine
(add_request) to its first schedule and its finish, on the collector's wall
clock: the oldest request still waiting, the queue and end-to-end times,
per tier. `RequestLog` keeps, for the most recent finished requests, the engine step
and wall time they finished at, how they finished (vLLM's finish reason:
stop, length, abort, error, repetition), their end-to-end time (arrival in
the engine to finish) and their queue time (arrival in the engine to the
first schedule). `ChangeMarks` keeps the engine's cumulative counters at the
moment a knob change was applied, keyed by the first step that ran with it.

Together they answer "what happened from step N on" with counter deltas and
per-request values of requests that finished from that step — never a
trailing window that still holds the time before the change.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING, Any, Final, NamedTuple

from vllm_runbook.collector import metrics as M
from vllm_runbook.collector.agent_api import Before, DrainingSince, SettledSince
from vllm_runbook.collector.exporter import Sample

if TYPE_CHECKING:
    from vllm_runbook.collector.step_stats import StepStats
    from vllm_runbook.collector.vllm_types import Request, VllmScheduler

# Enough for minutes of a busy engine; the oldest entries fall off.
LOG_LENGTH: Final = 65_536
MARKS_KEPT: Final = 64
# The counters' history a change's "before" is read from: one sample a second
# while the engine steps, 30 minutes of it (the breaker watches a change for
# 10 minutes and compares it with as long before it).
HISTORY_INTERVAL_S: Final = 1.0
HISTORY_KEPT: Final = 1800
# A change's "starving" requests: the oldest this many waiting for their first
# schedule when it took effect (what a starvation fix is for).
STARVING_WATCHED: Final = 8
FINISH_REASONS: Final = ("stop", "length", "abort", "error", "repetition")


class Finished(NamedTuple):
    """A finished request. A named tuple, not a frozen dataclass: one is built per
    request in the engine's step, and a frozen dataclass's __init__ (a
    object.__setattr__ per field) costs 2 µs there, a tuple 0.3 µs."""

    step: int  # the scheduler step count when the request finished
    time: float  # wall time of the finish
    reason: str  # vLLM's finish reason (stop | length | abort | error | repetition)
    e2e_seconds: float  # arrival in the engine → finish
    queue_seconds: float  # arrival in the engine → first schedule (→ finish if never)
    prompt_tokens: int = 0
    output_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Mark:
    """Cumulative counters when a change took effect.

    Most changes take effect at the first step scheduled with them. A lower
    admission limit (max_num_seqs) takes effect once the running requests
    above it have drained (finished or preempted, not readmitted): until
    then the mark is `settled=False` and its counters are those at apply
    time; the collector replaces it when running <= the limit."""

    step: int  # the step counting starts from (the first step with the change in effect)
    time: float  # wall time of that moment
    steps: int
    preemptions: int
    scheduled_tokens: int
    prefix_queries: int
    prefix_hits: int
    applied_step: int = 0  # the first step scheduled with the change (the key)
    settled: bool = True
    # The oldest requests waiting for their first schedule at that moment (ids),
    # and how long the oldest of them had waited.
    starving: tuple[str, ...] = ()
    starving_oldest_seconds: float = 0.0
    # Requests first scheduled until then, and per second over the window before.
    first_schedules: int = 0
    admitted_per_second: float | None = None
    # Requests finished until then (all reasons, and with an error).
    finished: int = 0
    errors: int = 0


def percentile(values: Iterable[float], q: float) -> float | None:
    """Nearest-rank percentile (`q` in 0..1); None for no values.
    Nearest rank keeps the answer one of the measured values (exact oracles)."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


class Histogram:
    """Bucket counts (le bounds, +Inf last, not cumulative) and the sum of
    every value observed: the Prometheus histogram of all finished requests,
    not only the ones the log still holds."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # le semantics: a value equal to a bound counts in that bound's bucket.
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


class RequestLog:
    """The latest finished requests (engine thread appends, HTTP threads read).

    The histograms are observed by their readers (a scrape), not in the
    engine's step: `add` queues the entry (deque.append, atomic under the GIL),
    and reading a histogram first observes what is queued, under a lock (one
    reader at a time). Nobody reading for `length` finishes: the engine thread
    observes them itself, so the queue stays bounded."""

    def __init__(
        self, length: int = LOG_LENGTH, bounds: Sequence[float] = (1.0, 10.0, 60.0)
    ) -> None:
        self.entries: deque[Finished] = deque(maxlen=length)
        self.by_reason: dict[str, int] = dict.fromkeys(FINISH_REASONS, 0)
        self._queue_histogram = Histogram(bounds)
        self._e2e_histogram = Histogram(bounds)
        self._unobserved: deque[Finished] = deque()
        self._observe_at = length
        self._observe_lock = threading.Lock()

    def add(self, entry: Finished) -> None:
        by_reason = self.by_reason
        by_reason[entry.reason] = by_reason.get(entry.reason, 0) + 1
        self.entries.append(entry)
        unobserved = self._unobserved
        unobserved.append(entry)
        if len(unobserved) >= self._observe_at:
            self.observe_queued()

    def observe_queued(self) -> None:
        """Observe the queued entries into the histograms (any thread)."""
        with self._observe_lock:
            unobserved, queue, e2e = self._unobserved, self._queue_histogram, self._e2e_histogram
            for _ in range(len(unobserved)):  # only this lock's holder pops
                entry = unobserved.popleft()
                queue.observe(entry.queue_seconds)
                e2e.observe(entry.e2e_seconds)

    @property
    def queue_histogram(self) -> Histogram:
        """Arrival in the engine → first schedule, every finished request."""
        self.observe_queued()
        return self._queue_histogram

    @property
    def e2e_histogram(self) -> Histogram:
        """Arrival in the engine → finish, every finished request."""
        self.observe_queued()
        return self._e2e_histogram

    def _snapshot(self) -> list[Finished]:
        # list(deque) runs in C under the GIL: no concurrent append can interleave.
        return list(self.entries)

    def since_step(self, step: int) -> list[Finished]:
        return [e for e in self._snapshot() if e.step >= step]

    def since_time(self, since: float) -> list[Finished]:
        return [e for e in self._snapshot() if e.time >= since]


def summarize(entries: list[Finished]) -> dict[str, Any]:
    """Request outcomes over `entries`: counts by reason, error rate, P99s (None when empty)."""
    by_reason = dict.fromkeys(FINISH_REASONS, 0)
    for e in entries:
        by_reason[e.reason] = by_reason.get(e.reason, 0) + 1
    total = len(entries)
    return {
        "requests_finished": total,
        "finished_by_reason": by_reason,
        "error_rate": by_reason["error"] / total if total else None,
        "engine_e2e_latency_p99": percentile((e.e2e_seconds for e in entries), 0.99),
        "engine_queue_time_p99": percentile((e.queue_seconds for e in entries), 0.99),
    }


def length_spread(lengths: list[int]) -> float | None:
    """P90 / P10 (nearest rank); None without lengths."""
    ordered = sorted(lengths)  # once: this runs at every scrape over the window's arrivals
    p10, p90 = percentile(ordered, 0.10), percentile(ordered, 0.90)
    return None if p10 is None or p90 is None else p90 / max(p10, 1)


def long_share(lengths: list[int]) -> float | None:
    """Share above metrics.LONG_PROMPT_TOKENS; None without lengths."""
    if not lengths:
        return None
    return sum(1 for n in lengths if n > M.LONG_PROMPT_TOKENS) / len(lengths)


def requests_in_engine(
    stays: Iterable[tuple[float, float]], start: float, end: float
) -> tuple[int, float]:
    """(most at once, time-weighted mean) of the requests in the engine over
    [start, end], from each request's (arrival, finish) in the engine."""
    events: list[tuple[float, int]] = []
    total = 0.0
    for arrived, left in stays:
        begin, finish = max(arrived, start), min(left, end)
        if finish < begin:
            continue
        total += finish - begin
        events.append((begin, 1))
        if left <= end:
            events.append((finish, -1))
    peak = count = 0
    for _, change in sorted(events):  # a finish before an arrival at the same instant
        count += change
        peak = max(peak, count)
    span = end - start
    return peak, total / span if span > 0 else 0.0


def length_summary(lengths: list[int]) -> dict[str, float | None]:
    ordered = sorted(lengths)
    return {
        "count": len(ordered),
        **{f"p{q}": percentile(ordered, q / 100) for q in (10, 50, 90, 99)},
        "max": ordered[-1] if ordered else None,
    }


class ChangeMarks:
    """The counters at the latest applied changes, by first step with the change."""

    def __init__(self, kept: int = MARKS_KEPT) -> None:
        self.kept = kept
        self.marks: OrderedDict[int, Mark] = OrderedDict()

    def add(self, key: int, mark: Mark, replace: bool = False) -> None:
        # Several commands drained before one step share its mark: keep the first.
        if key in self.marks and not replace:
            return
        self.marks[key] = mark
        while len(self.marks) > self.kept:
            self.marks.popitem(last=False)

    def get(self, step: int) -> Mark | None:
        return self.marks.get(step)


def first_wait_statuses() -> frozenset[Any]:
    """vLLM's statuses of a request waiting for its first schedule: WAITING and
    the waits before it (grammar, remote KV). Not WAITING_FOR_STREAMING_REQ:
    that one ran and waits for input."""
    from vllm.v1.request import RequestStatus

    return frozenset(
        s for s in RequestStatus if s.name.startswith("WAITING") and "STREAMING" not in s.name
    )


def finish_reasons() -> dict[Any, str]:
    """vLLM's finish reason (its string) of each finished status; a status not
    in it (not finished) is logged as "abort"."""
    from vllm.v1.request import RequestStatus

    reasons: dict[Any, str] = {}
    for status in RequestStatus:
        reason = RequestStatus.get_finished_reason(status)
        if reason is not None:
            reasons[status] = str(reason)
    return reasons


class RequestTracker:
    """Each request from its arrival in the engine to its finish. End-to-end and
    queue times are the engine's: from its add_request, on `clock` (wall time).

    Data sources: the scheduler (its `requests` by id), the step count of
    `stats`, and `tier_of` (prompt tokens → tier index). Engine thread writes;
    other threads read the oldest waiting request, the log and the histograms."""

    def __init__(
        self,
        scheduler: VllmScheduler,
        stats: StepStats,
        tier_of: Callable[[int], int],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.scheduler = scheduler
        self.stats = stats
        self.tier_of = tier_of
        self.clock = clock
        self.log = RequestLog(bounds=M.REQUEST_SECONDS_BUCKETS)
        # Request id -> wall time it reached the engine, and -> seconds it waited
        # for its first schedule (both until it finishes).
        self.arrived: dict[str, float] = {}
        self._queue_seconds: dict[str, float] = {}
        # Requests never scheduled yet, in the order they reached the engine:
        # (request id, wall time of add_request). Only the head is looked at,
        # once per step; entries behind it that were scheduled or aborted
        # meanwhile are dropped when they reach it.
        self.never_scheduled: deque[tuple[str, float]] = deque()
        # (wall time, prompt tokens) of the latest arrivals: the workload's lengths.
        self.arrivals: deque[tuple[float, int]] = deque(maxlen=LOG_LENGTH)
        self.first_wait = first_wait_statuses()
        self._head_lock = threading.Lock()  # readers drop the heads (oldest_waiting_since)
        self._horizon_lock = threading.Lock()
        self._horizon_floor = 0.0
        # Requests scheduled for the first time, and when (the drain rate).
        self.first_schedules = 0
        self._first_schedule_times: deque[float] = deque(maxlen=LOG_LENGTH)
        # Per tier: seconds from arrival in the engine to the first schedule.
        # Observed at scrape like the log's: (prompt tokens, seconds) queued in the step.
        self._tier_histograms = tuple(Histogram(M.REQUEST_SECONDS_BUCKETS) for _ in M.TIERS)
        self._tier_unobserved: deque[tuple[int, float]] = deque()
        self._tier_lock = threading.Lock()
        # vLLM's finish reason of each finished status, as the log keeps it.
        self._reason_of = finish_reasons()

    # -- engine thread -----------------------------------------------------------

    def on_add_request(self, request: Request) -> None:
        """A request reached the engine: it waits for its first schedule from now."""
        since = self.clock()
        self.never_scheduled.append((request.request_id, since))
        self.arrived[request.request_id] = since
        self.arrivals.append((since, request.num_prompt_tokens))

    def on_schedule(self, scheduler: VllmScheduler, output: Any) -> None:
        """After a schedule() that scheduled new requests: the queue time of
        each one scheduled for the first time."""
        if output.scheduled_new_reqs:
            now = self.clock()
            arrived, queued = self.arrived, self._queue_seconds
            requests, unobserved = scheduler.requests, self._tier_unobserved
            times = self._first_schedule_times
            for new in output.scheduled_new_reqs:
                request_id = new.req_id
                since = arrived.get(request_id)
                if since is not None and request_id not in queued:
                    self.first_schedules += 1
                    times.append(now)
                    seconds = queued[request_id] = max(0.0, now - since)
                    request = requests.get(request_id)
                    if request is not None:
                        unobserved.append((request.num_prompt_tokens, seconds))
            if len(unobserved) >= LOG_LENGTH:  # nobody scraped for that long
                self.observe_queued()

    def on_request_finished(self, request: Request) -> None:
        """A request is being freed (finished, length-capped, aborted, failed)."""
        now = self.clock()
        request_id = request.request_id
        queued = self._queue_seconds.pop(request_id, None)
        arrived = self.arrived.pop(request_id, None)
        if queued is None:  # never scheduled: it waited until now
            queued = max(0.0, now - arrived) if arrived is not None else 0.0
        self.log.add(
            Finished(
                self.stats.steps,
                now,
                self._reason_of.get(request.status, "abort"),
                max(0.0, now - arrived) if arrived is not None else 0.0,
                queued,
                request.num_prompt_tokens,
                request.num_output_tokens,
            )
        )

    # -- any thread ----------------------------------------------------------------

    def observe_queued(self) -> None:
        """Observe the queue times queued by `on_schedule` into the tiers' histograms."""
        with self._tier_lock:
            unobserved, histograms, tier_of = (
                self._tier_unobserved,
                self._tier_histograms,
                self.tier_of,
            )
            for _ in range(len(unobserved)):  # only this lock's holder pops
                prompt_tokens, seconds = unobserved.popleft()
                histograms[tier_of(prompt_tokens)].observe(seconds)

    @property
    def tier_queue_histograms(self) -> tuple[Histogram, ...]:
        """Per tier: arrival in the engine → first schedule, every request scheduled."""
        self.observe_queued()
        return self._tier_histograms

    @property
    def oldest_waiting_since(self) -> float | None:
        """When the oldest request still waiting for its first schedule reached
        the engine; None when none waits. Any thread. The heads no longer
        waiting are dropped here, by whoever reads (under a lock: readers race;
        only the engine thread appends), not in every step: the engine thread
        reads it once a second (the episode's sample), which keeps the queue
        short while nobody scrapes. Nothing waits its first schedule again once
        scheduled, so a late drop sees what a step's would have."""
        queue, requests, first_wait = self.never_scheduled, self.scheduler.requests, self.first_wait
        with self._head_lock:
            while queue:
                request_id, since = queue[0]
                request = requests.get(request_id)
                if request is not None and request.status in first_wait:
                    return since
                queue.popleft()
        return None

    def waiting_horizon(self) -> tuple[float, float]:
        """(age, admitted_before): how long the oldest request waiting for its first
        schedule has been in the engine (0 when none waits), and the time before
        which every request the engine received has been scheduled at least once
        (that request's arrival in the engine, or now when none waits).

        `admitted_before` never decreases (a floor under a lock, as HTTP threads
        race with the engine thread's add): it stands still while a request
        starves and moves on as the queue is served."""
        now = self.clock()
        since = self.oldest_waiting_since
        age = 0.0 if since is None else max(0.0, now - since)
        with self._horizon_lock:
            horizon = max(self._horizon_floor, now if since is None else since)
            self._horizon_floor = horizon
        return age, horizon

    def oldest_waiting(self, n: int = STARVING_WATCHED) -> list[tuple[str, float]]:
        """The `n` requests waiting longest for their first schedule: (id, arrival
        in the engine), oldest first. Any thread (a copy of the queue is walked)."""
        requests, first_wait = self.scheduler.requests, self.first_wait
        oldest: list[tuple[str, float]] = []
        for request_id, since in list(self.never_scheduled):
            request = requests.get(request_id)
            if request is not None and request.status in first_wait:
                oldest.append((request_id, since))
                if len(oldest) >= n:
                    break
        return oldest

    def still_waiting(self, request_ids: Iterable[str]) -> int:
        """How many of `request_ids` still wait for their first schedule."""
        requests, first_wait = self.scheduler.requests, self.first_wait
        return sum(
            1
            for rid in request_ids
            if (r := requests.get(rid)) is not None and r.status in first_wait
        )

    def admitted_per_second(self, window_seconds: float) -> float | None:
        """Requests scheduled for the first time per second over the trailing window."""
        if window_seconds <= 0:
            return None
        times = list(self._first_schedule_times)
        start = self.clock() - window_seconds
        return (len(times) - bisect.bisect_left(times, start)) / window_seconds

    def window_summary(self, window_seconds: float) -> dict[str, Any]:
        """Request outcomes over the trailing window (see `summarize`)."""
        return summarize(self.log.since_time(self.clock() - window_seconds))

    def arrived_prompt_tokens(self, window_seconds: float) -> list[int]:
        """Prompt lengths of the requests that reached the engine in the window."""
        since = self.clock() - window_seconds
        return [n for t, n in list(self.arrivals) if t >= since]

    def workload(self, window_seconds: float) -> dict[str, Any]:
        """Prompt and output lengths over the window (nearest-rank percentiles):
        prompts of the requests that arrived, outputs of those that finished;
        and how many requests were in the engine at once."""
        now = self.clock()
        prompts = self.arrived_prompt_tokens(window_seconds)
        finished = self.log.since_time(now - window_seconds)
        outputs = [e.output_tokens for e in finished]
        # Each request's time in the engine: the finished ones', then the ones in flight.
        stays = [(e.time - e.e2e_seconds, e.time) for e in finished]
        stays += [(arrived, now) for arrived in list(self.arrived.values())]
        peak, mean = requests_in_engine(stays, now - window_seconds, now)
        return {
            "window_seconds": window_seconds,
            "requests_arrived": len(prompts),
            "prompt_tokens": length_summary(prompts),
            "output_tokens": length_summary(outputs),
            "prompt_length_spread_ratio": length_spread(prompts),
            "long_prompt_ratio": long_share(prompts),
            "requests_in_engine_peak": peak,
            "requests_in_engine_mean": mean,
        }

    def samples(self) -> list[Sample]:
        log = self.log
        prompts = self.arrived_prompt_tokens(self.stats.window_seconds)
        spread, long_ratio = length_spread(prompts), long_share(prompts)
        return [
            Sample(M.OLDEST_WAITING, self.waiting_horizon()[0]),
            Sample(M.PROMPT_LENGTH_SPREAD, math.nan if spread is None else spread),
            Sample(M.LONG_PROMPT_RATIO, math.nan if long_ratio is None else long_ratio),
            *(
                Sample(M.REQUESTS_FINISHED, count, (reason,))
                for reason, count in log.by_reason.items()
            ),
            *(
                Sample(spec, h.sum, buckets=tuple(accumulate(h.counts)))
                for spec, h in (
                    (M.REQUEST_QUEUE_SECONDS, log.queue_histogram),
                    (M.REQUEST_E2E_SECONDS, log.e2e_histogram),
                )
            ),
            *(
                Sample(M.TIER_QUEUE_SECONDS, h.sum, (tier,), buckets=tuple(accumulate(h.counts)))
                for tier, h in zip(M.TIERS, self.tier_queue_histograms, strict=True)
            ),
        ]


class ChangeTracker:
    """The counters when each knob change took effect, and what happened since.

    A change is marked when it is applied (any thread, under the scheduler
    lock), keyed by its first step. A lower admission limit with more requests
    running than it admits takes effect only once they drain: its mark is
    settled after the first step that shows it in effect (`on_schedule`)."""

    def __init__(
        self,
        scheduler: Any,
        stats: StepStats,
        requests: RequestTracker,
        clock: Callable[[], float] = time.time,
        window_seconds: float = 60.0,
    ) -> None:
        self.scheduler = scheduler
        self.stats = stats
        self.requests = requests
        self.clock = clock  # sets next_sample_at
        self.window_seconds = window_seconds
        self.marks = ChangeMarks()
        # The applied step of a lower admission limit still draining, if any.
        self.settling: int | None = None
        # Told after `settling` is set (the hook's slow path checks it).
        self.wake: Callable[[], None] = lambda: None
        # (time, preemptions, finished, errors), one sample a second while the
        # engine steps: what the time before a change is measured from.
        self.history: deque[tuple[float, int, int, int]] = deque(maxlen=HISTORY_KEPT)
        self._next_sample = 0.0

    @property
    def clock(self) -> Callable[[], float]:
        return self._clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        # The step's time.monotonic() from which `sample` is called again: the
        # engine thread skips the call (and its clock read) until then. Only on
        # the real wall clock: a test's clock may run faster than the steps.
        self._gated = clock is time.time
        self.next_sample_at = 0.0

    def sample(self, step_time: float | None = None) -> float | None:
        """After a step (engine thread): one clock read, a sample once a second.
        The time sampled at, None when not sampled (the episode's gauges ride on it).
        `step_time`: the step's time.monotonic(), which sets `next_sample_at`."""
        now = self.clock()
        # (A wall clock set back more than a sample starts the samples again.)
        if now >= self._next_sample or now < self._next_sample - 2 * HISTORY_INTERVAL_S:
            self._next_sample = now + HISTORY_INTERVAL_S
            if step_time is not None and self._gated:
                self.next_sample_at = step_time + HISTORY_INTERVAL_S
            self.history.append((now, self.stats.preemptions, *self._finished()))
            return now
        return None

    def _finished(self) -> tuple[int, int]:
        by_reason = self.requests.log.by_reason
        return sum(by_reason.values()), by_reason.get("error", 0)

    def on_change_applied(self, effective_from_step: int) -> None:
        """A knob change was applied: keep the counters as they stand before its first step."""
        settled = len(self.scheduler.running) <= self.scheduler.max_num_active_reqs
        self.marks.add(effective_from_step, self._mark(effective_from_step, settled))
        if not settled:
            self.settling = effective_from_step
            self.wake()

    def check_settled(self, scheduler: Any) -> None:
        """After schedule(), update_from_output() or an abort (engine thread, only
        while a mark is settling): the running fell to the limit. It falls when a
        request finishes, in update_from_output, or is aborted; the last of a
        draining batch may finish with nothing queued behind it, and an idle
        engine calls schedule() no more: checked there too, or the change would
        read as draining for ever."""
        if self.settling is not None and len(scheduler.running) <= scheduler.max_num_active_reqs:
            # The admission limit is in effect from the next step on.
            self.marks.add(self.settling, self._mark(self.settling, True), replace=True)
            self.settling = None

    def _mark(self, applied_step: int, settled: bool) -> Mark:
        stats, requests = self.stats, self.requests
        now = self.clock()
        starving = requests.oldest_waiting()
        finished, errors = self._finished()
        return Mark(
            step=stats.steps + 1,
            time=now,
            steps=stats.steps,
            preemptions=stats.preemptions,
            scheduled_tokens=stats.scheduled_tokens,
            prefix_queries=stats.prefix_queries,
            prefix_hits=stats.prefix_hits,
            applied_step=applied_step,
            settled=settled,
            starving=tuple(rid for rid, _ in starving),
            starving_oldest_seconds=max(0.0, now - starving[0][1]) if starving else 0.0,
            first_schedules=requests.first_schedules,
            admitted_per_second=requests.admitted_per_second(self.window_seconds),
            finished=finished,
            errors=errors,
        )

    def since(self, step: int) -> SettledSince | DrainingSince | None:
        """What happened from `step` (a change's first step) on; None when unknown.
        HTTP thread."""
        mark = self.marks.get(step)
        if mark is None:
            return None
        if not mark.settled:
            return DrainingSince(
                from_step=step,
                settled=False,
                requests_running=len(self.scheduler.running),
                max_num_seqs=int(self.scheduler.max_num_active_reqs),
            )
        stats = self.stats
        seconds = max(0.0, self.clock() - mark.time)
        steps, preemptions, scheduled_tokens = stats.progress
        preempted = preemptions - mark.preemptions
        scheduled = scheduled_tokens - mark.scheduled_tokens
        queries = stats.prefix_queries - mark.prefix_queries
        hits = stats.prefix_hits - mark.prefix_hits
        return SettledSince(
            from_step=step,
            settled=True,
            effective_step=mark.step,
            from_time=mark.time,
            seconds=seconds,
            steps=steps - mark.steps,
            preemptions=preempted,
            preemptions_per_minute=preempted * 60.0 / seconds if seconds > 0 else None,
            scheduled_tokens=scheduled,
            scheduled_tokens_per_second=scheduled / seconds if seconds > 0 else None,
            kv_hit_ratio=hits / queries if queries else None,
            starving_at_change=len(mark.starving),
            starving_oldest_seconds=mark.starving_oldest_seconds,
            starving_waiting=self.requests.still_waiting(mark.starving),
            admitted=self.requests.first_schedules - mark.first_schedules,
            admitted_per_second_before=mark.admitted_per_second,
            before=self.before(mark, seconds),
            **summarize(self.requests.log.since_step(mark.step)),
        )

    def before(self, mark: Mark, seconds: float) -> Before | None:
        """The counters over `seconds` before `mark` (the latest sample at or
        before that moment; the oldest one where the history does not reach
        back). None when no sample precedes the mark."""
        samples = [h for h in list(self.history) if h[0] <= mark.time]
        if not samples:
            return None
        start = mark.time - seconds
        times = [h[0] for h in samples]
        at = bisect.bisect_right(times, start) - 1
        t0, preemptions, finished, errors = samples[max(at, 0)]
        window = [e for e in self.requests.log.since_time(t0) if e.time < mark.time]
        return Before(
            seconds=mark.time - t0,
            preemptions=mark.preemptions - preemptions,
            requests_finished=mark.finished - finished,
            errors=mark.errors - errors,
            engine_e2e_latency_p99=percentile((e.e2e_seconds for e in window), 0.99),
        )

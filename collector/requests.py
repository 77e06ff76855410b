"""Finished requests and change marks: what a verification reads after a change.

`RequestLog` keeps, for the most recent finished requests, the engine step
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
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

# Enough for minutes of a busy engine; the oldest entries fall off.
LOG_LENGTH: Final = 65_536
MARKS_KEPT: Final = 64
FINISH_REASONS: Final = ("stop", "length", "abort", "error", "repetition")


@dataclass(frozen=True, slots=True)
class Finished:
    step: int  # the scheduler step count when the request finished
    time: float  # wall time of the finish
    reason: str  # vLLM's finish reason (stop | length | abort | error | repetition)
    e2e_seconds: float  # arrival in the engine → finish
    queue_seconds: float  # arrival in the engine → first schedule (→ finish if never)


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
    """The latest finished requests (engine thread appends, HTTP threads read)."""

    def __init__(
        self, length: int = LOG_LENGTH, bounds: Sequence[float] = (1.0, 10.0, 60.0)
    ) -> None:
        self.entries: deque[Finished] = deque(maxlen=length)
        self.by_reason: dict[str, int] = dict.fromkeys(FINISH_REASONS, 0)
        self.queue_histogram = Histogram(bounds)
        self.e2e_histogram = Histogram(bounds)

    def add(self, entry: Finished) -> None:
        self.by_reason[entry.reason] = self.by_reason.get(entry.reason, 0) + 1
        self.queue_histogram.observe(entry.queue_seconds)
        self.e2e_histogram.observe(entry.e2e_seconds)
        self.entries.append(entry)

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
        "p99_latency_seconds": percentile((e.e2e_seconds for e in entries), 0.99),
        "waiting_seconds_p99": percentile((e.queue_seconds for e in entries), 0.99),
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

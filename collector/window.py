"""Sliding windows over the last N seconds, kept in one-second buckets.

One thread writes (the scheduler, every step); any thread reads (the HTTP
thread at scrape time). The newest second is one tuple the writer replaces
whole, so a step inside the same second costs no lock: a reader sees the
tuple before or after, both whole. The writer takes the lock only when a
new second starts (it moves the finished second into the deque and expires
old ones); readers take it to expire and sum, so a scrape after the engine
went idle still sees the window slide.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from itertools import accumulate

NO_SECOND = -(2**62)  # before any second a clock can read
QUEUED_LIMIT = 65_536  # values a QueuedHistogram queues before its writer files them


class SlidingWindowRatio:
    """numerator/denominator summed over the last `window_seconds`. One writer."""

    __slots__ = ("_buckets", "_clock", "_current", "_den", "_lock", "_num", "window_seconds")

    def __init__(
        self, window_seconds: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if window_seconds <= 0:
            raise ValueError("window_seconds must be > 0")
        self.window_seconds = window_seconds
        self._clock = clock
        # The finished seconds, each (second, numerator, denominator), and their sums.
        self._buckets: deque[tuple[int, float, float]] = deque()
        self._num = 0.0
        self._den = 0.0
        # The newest second: (second, numerator, denominator), replaced whole.
        self._current: tuple[int, float, float] = (NO_SECOND, 0.0, 0.0)
        self._lock = threading.Lock()

    def _expire(self, now: float) -> None:
        horizon = int(now) - self.window_seconds
        buckets = self._buckets
        while buckets and buckets[0][0] <= horizon:
            _, num, den = buckets.popleft()
            self._num -= num
            self._den -= den
        if not buckets:  # reset accumulated float error when empty
            self._num = self._den = 0.0

    def add(self, numerator: float, denominator: float, now: float | None = None) -> None:
        """`now`: the window's clock read by the caller (saves a read)."""
        if now is None:
            now = self._clock()
        second = int(now)
        current = self._current
        if current[0] == second:
            self._current = (second, current[1] + numerator, current[2] + denominator)
            return
        with self._lock:
            if current[0] != NO_SECOND:
                self._buckets.append(current)
                self._num += current[1]
                self._den += current[2]
            self._current = (second, numerator, denominator)
            self._expire(now)

    def sums(self) -> tuple[float, float]:
        with self._lock:
            now = self._clock()
            self._expire(now)
            second, num, den = self._current
            if second > int(now) - self.window_seconds:
                return self._num + num, self._den + den
            return self._num, self._den

    def ratio(self, empty: float = 0.0) -> float:
        """numerator/denominator over the window; `empty` when nothing was added."""
        num, den = self.sums()
        return num / den if den > 0 else empty


class SlidingWindowMax:
    """The largest value added over the last `window_seconds`. One writer."""

    __slots__ = ("_buckets", "_clock", "_lock", "_newest", "window_seconds")

    def __init__(
        self, window_seconds: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if window_seconds <= 0:
            raise ValueError("window_seconds must be > 0")
        self.window_seconds = window_seconds
        self._clock = clock
        self._buckets: deque[tuple[int, float]] = deque()  # finished seconds: (second, max)
        # The newest second: (second, max), replaced whole.
        self._newest: tuple[int, float] = (NO_SECOND, 0.0)
        self._lock = threading.Lock()

    def add(self, value: float, now: float | None = None) -> None:
        """`now`: the window's clock read by the caller (saves a read)."""
        second = int(self._clock() if now is None else now)
        current = self._newest
        if current[0] == second:
            if value > current[1]:
                self._newest = (second, value)
            return
        with self._lock:
            buckets = self._buckets
            if current[0] != NO_SECOND:
                buckets.append(current)
            self._newest = (second, value)
            horizon = second - self.window_seconds
            while buckets and buckets[0][0] <= horizon:
                buckets.popleft()

    def max(self, empty: float = 0.0) -> float:
        horizon = int(self._clock()) - self.window_seconds
        with self._lock:
            values = [v for s, v in self._buckets if s > horizon]
            second, value = self._newest
        if second > horizon:
            values.append(value)
        return max(values, default=empty)


class QueuedHistogram:
    """A Prometheus histogram filled by its reader: the writer only queues.

    The one writer appends each value to `queue` (deque.append: atomic under
    the GIL, no lock, no bisect in its thread); a reader files what is queued
    into the buckets under a lock, then reads them. A writer that finds
    `limit` values queued (nobody read for that long) files them itself."""

    __slots__ = ("_counts", "_lock", "_sum", "bounds", "limit", "queue")

    def __init__(self, bounds: Sequence[float], limit: int = QUEUED_LIMIT) -> None:
        self.bounds = tuple(bounds)
        self.limit = limit
        self.queue: deque[float] = deque()
        self._counts = [0] * (len(self.bounds) + 1)  # le buckets, +Inf last
        self._sum = 0.0
        self._lock = threading.Lock()

    def add(self, value: float) -> None:
        """The writer's step, as a call (a hot path inlines these lines)."""
        queue = self.queue
        queue.append(value)
        if len(queue) >= self.limit:
            self.file()

    def file(self) -> None:
        """Move the queued values into the buckets (any thread)."""
        with self._lock:
            self._file()

    def read(self) -> tuple[list[int], float]:
        """(cumulative counts with +Inf last, sum) of every value added so far."""
        with self._lock:
            self._file()
            return list(accumulate(self._counts)), self._sum

    def _file(self) -> None:
        queue, counts, bounds = self.queue, self._counts, self.bounds
        total = 0.0
        for _ in range(len(queue)):  # only the lock's holder pops
            value = queue.popleft()
            # le semantics: a value equal to a bound counts in that bound's bucket.
            counts[bisect.bisect_left(bounds, value)] += 1
            total += value
        self._sum += total

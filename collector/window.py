"""A sliding-window ratio of two sums, kept in one-second buckets.

The scheduler thread adds to it every step; the HTTP thread reads it at
scrape time. Both take a lock (uncontended in practice: one scrape every few
seconds), so a scrape after the engine went idle still sees the window slide.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable


class SlidingWindowRatio:
    """numerator/denominator summed over the last `window_seconds`."""

    __slots__ = ("_buckets", "_clock", "_den", "_lock", "_num", "window_seconds")

    def __init__(
        self, window_seconds: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if window_seconds <= 0:
            raise ValueError("window_seconds must be > 0")
        self.window_seconds = window_seconds
        self._clock = clock
        # Each bucket: [second, numerator, denominator].
        self._buckets: deque[list[float]] = deque()
        self._num = 0.0
        self._den = 0.0
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

    def add(self, numerator: float, denominator: float) -> None:
        now = self._clock()
        second = int(now)
        with self._lock:
            buckets = self._buckets
            if buckets and buckets[-1][0] == second:
                bucket = buckets[-1]
                bucket[1] += numerator
                bucket[2] += denominator
            else:
                buckets.append([second, numerator, denominator])
                self._expire(now)
            self._num += numerator
            self._den += denominator

    def sums(self) -> tuple[float, float]:
        with self._lock:
            self._expire(self._clock())
            return self._num, self._den

    def ratio(self, empty: float = 0.0) -> float:
        """numerator/denominator over the window; `empty` when nothing was added."""
        num, den = self.sums()
        return num / den if den > 0 else empty


class SlidingWindowMax:
    """The largest value added over the last `window_seconds`, per-second buckets."""

    __slots__ = ("_buckets", "_clock", "_lock", "window_seconds")

    def __init__(
        self, window_seconds: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if window_seconds <= 0:
            raise ValueError("window_seconds must be > 0")
        self.window_seconds = window_seconds
        self._clock = clock
        self._buckets: deque[list[float]] = deque()  # [second, max]
        self._lock = threading.Lock()

    def add(self, value: float) -> None:
        second = int(self._clock())
        with self._lock:
            buckets = self._buckets
            if buckets and buckets[-1][0] == second:
                if value > buckets[-1][1]:
                    buckets[-1][1] = value
                return
            buckets.append([second, value])
            horizon = second - self.window_seconds
            while buckets[0][0] <= horizon:
                buckets.popleft()

    def max(self, empty: float = 0.0) -> float:
        horizon = int(self._clock()) - self.window_seconds
        with self._lock:
            values = [v for s, v in self._buckets if s > horizon]
        return max(values, default=empty)

"""In-memory time-series windows: one compact buffer per series, grouped by engine.

Samples arrive from scrapes in time order. Each series keeps just enough
history for the longest window any rule reads it with (`retention`), in
`array('d')` buffers (8 bytes a value) that are compacted in place once half
of them has expired, so appends and trims are amortised O(1) and window
look-ups are a bisect. Counters also keep a reset-adjusted copy, which makes
rate() O(1) however long the window.

Range semantics match Prometheus: an instant read takes the newest sample at
most `lookback` (5 min) old, unless the series went stale; a range [t-w, t] is
left-open in Prometheus 3 and closed in Prometheus 2 (`left_open`).
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

EngineKey = tuple[str, str, str]  # (instance, model_name, engine)
LOOKBACK_SECONDS = 300.0


class Series:
    __slots__ = ("adjusted", "labels", "le", "offset", "stale_at", "start", "ts", "values")

    def __init__(self, labels: Mapping[str, str], counter: bool) -> None:
        self.labels = dict(labels)
        # a histogram bucket's upper bound, read once (None: not a bucket, or an `le`
        # that is no number: histogram_quantile leaves such a bucket out)
        self.le = _upper_bound(self.labels.get("le"))
        self.ts = array("d")
        self.values = array("d")
        self.adjusted: array[float] | None = array("d") if counter else None
        self.offset = 0.0  # sum of the values seen just before each counter reset
        self.start = 0  # index of the oldest sample still inside retention
        self.stale_at: float | None = None

    def append(self, ts: float, value: float) -> None:
        if self.ts and ts <= self.ts[-1]:
            return  # duplicate or out of order: Prometheus drops these too
        if self.adjusted is not None:
            if self.values and value < self.values[-1]:
                self.offset += self.values[-1]
            self.adjusted.append(value + self.offset)
        self.ts.append(ts)
        self.values.append(value)
        self.stale_at = None

    def trim(self, before: float) -> None:
        """Forget samples older than `before`; compact once half the buffer is dead."""
        self.start = bisect_left(self.ts, before, self.start)
        if self.start > 64 and self.start * 2 > len(self.ts):
            del self.ts[: self.start]
            del self.values[: self.start]
            if self.adjusted is not None:
                del self.adjusted[: self.start]
            self.start = 0

    def __len__(self) -> int:
        return len(self.ts) - self.start


def _upper_bound(le: str | None) -> float | None:
    if le is None:
        return None
    try:
        return float(le)
    except ValueError:
        return None


@dataclass
class EngineSeries:
    """All stored series of one engine, by sample name."""

    key: EngineKey
    by_name: dict[str, list[Series]] = field(default_factory=dict)
    index: dict[tuple[str, frozenset[tuple[str, str]]], Series] = field(default_factory=dict)
    version: int = 0  # bumped when a series is added or dropped (invalidates look-up caches)
    resolved: dict[object, tuple[int, list[Series]]] = field(default_factory=dict)
    last_ts: float = -math.inf

    @property
    def labels(self) -> dict[str, str]:
        return {"instance": self.key[0], "model_name": self.key[1], "engine": self.key[2]}

    def matching(self, name: str, matchers: tuple[tuple[str, str], ...]) -> list[Series]:
        """Series of `name` whose labels equal all `matchers` (cached per version)."""
        cache_key = (name, matchers)
        hit = self.resolved.get(cache_key)
        if hit is not None and hit[0] == self.version:
            return hit[1]
        own = self.labels  # a series stores its labels without the engine's
        found = [
            s
            for s in self.by_name.get(name, ())
            if all(own.get(k, s.labels.get(k)) == v for k, v in matchers)
        ]
        self.resolved[cache_key] = (self.version, found)
        return found


class WindowStore:
    """Ring-buffered samples of the series the rules read, per engine."""

    def __init__(
        self,
        retention: Mapping[str, float],
        *,
        counters: Iterable[str] = (),
        lookback: float = LOOKBACK_SECONDS,
        left_open: bool = True,
        only: Mapping[str, Iterable[tuple[tuple[str, str], ...]]] | None = None,
    ) -> None:
        self.retention = dict(retention)  # sample name -> seconds of history to keep
        # sample name -> the label matchers its readers use: a series matching none of
        # them is not stored (an SLO reads one bucket of a histogram for days)
        self.only = {name: tuple(m) for name, m in (only or {}).items()}
        self.counters = set(counters)
        self.lookback = lookback
        self.left_open = left_open
        self.engines: dict[EngineKey, EngineSeries] = {}
        self._by_source: dict[str, set[Series]] = {}

    def wants(self, name: str) -> bool:
        return name in self.retention

    def engine(self, key: EngineKey) -> EngineSeries:
        eng = self.engines.get(key)
        if eng is None:
            eng = self.engines[key] = EngineSeries(key)
        return eng

    def add(
        self,
        instance: str,
        name: str,
        labels: Mapping[str, str],
        ts: float,
        value: float,
        seen: set[Series] | None = None,
    ) -> Series | None:
        """Append one sample; ignored unless a rule reads `name` and it names an engine."""
        if name not in self.retention:
            return None
        only = self.only.get(name)
        if only is not None and not any(all(labels.get(k) == v for k, v in m) for m in only):
            return None
        model, engine = labels.get("model_name"), labels.get("engine")
        if model is None or engine is None:
            return None  # not per engine (e.g. vllm:admission_rejections): no rule can use it
        eng = self.engine((instance, model, engine))
        rest = {k: v for k, v in labels.items() if k not in ("model_name", "engine", "instance")}
        key = (name, frozenset(rest.items()))
        series = eng.index.get(key)
        if series is None:
            series = eng.index[key] = Series(rest, name in self.counters)
            eng.by_name.setdefault(name, []).append(series)
            eng.version += 1
        series.append(ts, value)
        if ts > eng.last_ts:
            eng.last_ts = ts
        if seen is not None:
            seen.add(series)
        return series

    def end_scrape(self, source: str, ts: float, seen: set[Series]) -> None:
        """Series `source` exposed last time but not now go stale (like Prometheus)."""
        for series in self._by_source.get(source, set()) - seen:
            series.stale_at = ts
        self._by_source[source] = seen

    def mark_source_down(self, source: str, ts: float) -> None:
        """A failed scrape makes every series of that target stale at once."""
        for series in self._by_source.pop(source, set()):
            series.stale_at = ts

    def forget(self, instance: str, sources: Iterable[str] = ()) -> None:
        """An engine that left the inventory: drop its series (its alerts then resolve)."""
        for key in [k for k in self.engines if k[0] == instance]:
            del self.engines[key]
        for source in sources:
            self._by_source.pop(source, None)

    def trim(self, now: float) -> None:
        """Drop samples past retention, then empty series and engines."""
        for key in list(self.engines):
            eng = self.engines[key]
            for name, series_list in list(eng.by_name.items()):
                keep = self.retention.get(name, 0.0)
                for s in series_list:
                    s.trim(now - keep)
                alive = [s for s in series_list if len(s)]
                if len(alive) != len(series_list):
                    eng.version += 1
                    for s in series_list:
                        if not len(s):
                            eng.index.pop((name, frozenset(s.labels.items())), None)
                    if alive:
                        eng.by_name[name] = alive
                    else:
                        del eng.by_name[name]
            if not eng.by_name:
                del self.engines[key]

    def __iter__(self) -> Iterator[EngineSeries]:
        return iter(list(self.engines.values()))

    # -- reads (Prometheus semantics) -------------------------------------------
    def latest(self, s: Series, t: float) -> float | None:
        ts = s.ts
        hi = len(ts) if ts and ts[-1] <= t else bisect_right(ts, t, s.start)
        if hi <= s.start:
            return None
        sample_t = ts[hi - 1]
        if t - sample_t > self.lookback or (self.left_open and t - sample_t == self.lookback):
            return None
        if s.stale_at is not None and sample_t < s.stale_at <= t:
            return None
        return s.values[hi - 1]

    def bounds(self, s: Series, t: float, window: float) -> tuple[int, int]:
        """Index range [lo, hi) of the samples inside the window ending at t."""
        ts = s.ts
        hi = len(ts) if ts and ts[-1] <= t else bisect_right(ts, t, s.start)
        if self.left_open:
            lo = bisect_right(ts, t - window, s.start, hi)
        else:
            lo = bisect_left(ts, t - window, s.start, hi)
        return lo, hi

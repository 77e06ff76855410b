"""Backtest: the rule catalog replayed over a Prometheus' recorded history.

The series the rules read (vllm_runbook.rules.needs, through store_for_rules)
are read back from Prometheus' HTTP API in chunks, as raw samples (an instant
query of `name{selector}[chunk]`: a query_range answer is resampled at its
step, and a rate() over resampled points is not the rate Prometheus' rules
compute), into the same WindowStore the service fills by scraping; the same
Evaluator then runs at every `step` from `start` to `end`, `for:` and windows
as in the service. A chunk's samples are all read before any evaluation
inside it, and the store keeps only each series' longest window, so memory
stays bounded however long the range.

Known difference from the live service: staleness markers are not in the API's
answers, so a series that disappeared stays readable for the 5-minute
look-back (as a query at that time would not).

`Replay.read` gives any signal's value on an engine at a time in the replay
(runbook checks, knob values): `signal_expr` says how each is read from series.
"""

from __future__ import annotations

import asyncio
import json
import math
import ssl
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from vllm_runbook.collector import metrics as M
from vllm_runbook.collector.episode import kv_capacity_seqs
from vllm_runbook.rules import condition as C
from vllm_runbook.rules.compiler import Cache, Compiler, Fn
from vllm_runbook.rules.errors import RulesError
from vllm_runbook.rules.evaluator import Evaluator, store_for_rules
from vllm_runbook.rules.fetch import Fetcher, FetchError
from vllm_runbook.rules.incidents import IncidentEvent
from vllm_runbook.rules.model import Rule
from vllm_runbook.rules.signals import SIGNALS
from vllm_runbook.rules.window import EngineKey, WindowStore

CHUNK_SECONDS: Final = 3600.0
SIGNAL_WINDOW: Final = 60.0  # a derived signal (rate, p99) over the collector's window
SLACK: Final = 60.0
CONCURRENCY: Final = 4  # queries in flight at once
# A runbook-only signal computed from series: the series it is computed from.
COMPUTED: Final[Mapping[str, tuple[str, ...]]] = {
    "kv_capacity_seqs": (
        M.KV_BLOCKS_USED.series_name,
        M.KV_BLOCKS_FREE.series_name,
        M.REQUESTS_RUNNING.series_name,
    ),
}


class BacktestError(RulesError):
    """The range cannot be read (Prometheus does not answer, refuses, or a bad range)."""


# -- reading Prometheus ------------------------------------------------------------


@dataclass
class PrometheusRange:
    """Raw samples out of one Prometheus' HTTP API (credentials as discovery's)."""

    url: str
    bearer_token: str | None = None
    basic_auth: tuple[str, str] | None = None
    ssl_context: ssl.SSLContext | None = None
    timeout: float = 60.0
    selector: str = ""  # PromQL label matchers, e.g. instance=~"gpu-.*"
    queries: int = 0

    def _fetcher(self) -> Fetcher:
        return Fetcher(
            "vllm-runbook-backtest",
            ssl_context=self.ssl_context,
            auth=self.basic_auth,
            accept="application/json",
        )

    async def _get(self, fetcher: Fetcher, path: str, params: dict[str, str]) -> Any:
        from urllib.parse import urlencode

        url = f"{self.url.rstrip('/')}/api/v1/{path}?{urlencode(params)}"
        headers = {"Authorization": f"Bearer {self.bearer_token}"} if self.bearer_token else None
        self.queries += 1
        try:
            async with asyncio.timeout(self.timeout):
                status, body = await fetcher.get(url, headers)
        except TimeoutError:
            raise BacktestError(
                f"Prometheus {self.url}: no answer within {self.timeout:g} s"
            ) from None
        except (OSError, FetchError) as exc:
            raise BacktestError(f"Prometheus {self.url} did not answer: {exc}") from None
        try:
            answer = json.loads(body)
        except ValueError:
            raise BacktestError(
                f"{self.url} answered HTTP {status}, not as Prometheus' API does"
            ) from None
        if status != 200 or answer.get("status") != "success":
            error = answer.get("error", f"HTTP {status}") if isinstance(answer, dict) else status
            raise BacktestError(
                f"Prometheus {self.url} refused {params.get('query', path)}: {error}"
            )
        return answer["data"]

    def major_version(self) -> int | None:
        """Prometheus' major version (3: left-open ranges), None when it does not say."""

        async def ask() -> Any:
            fetcher = self._fetcher()
            try:
                return await self._get(fetcher, "status/buildinfo", {})
            finally:
                await fetcher.aclose()

        try:
            version = str(asyncio.run(ask()).get("version", ""))
            return int(version.split(".")[0])
        except (BacktestError, ValueError, AttributeError):
            return None

    async def chunk(
        self, fetcher: Fetcher, names: Sequence[str], start: float, end: float
    ) -> list[tuple[str, dict[str, str], list[list[Any]]]]:
        """Every sample of `names` in (start, end] (closed on Prometheus 2)."""
        span_ms = max(1, round((end - start) * 1000))
        limit = asyncio.Semaphore(CONCURRENCY)
        inner = self.selector.strip().strip("{}")

        async def one(name: str) -> list[tuple[str, dict[str, str], list[list[Any]]]]:
            query = f"{{__name__={json.dumps(name)}{',' + inner if inner else ''}}}[{span_ms}ms]"
            async with limit:
                data = await self._get(fetcher, "query", {"query": query, "time": repr(end)})
            return [(name, r["metric"], r["values"]) for r in data.get("result", [])]

        parts = await asyncio.gather(*(one(n) for n in names))
        return [x for part in parts for x in part]


# -- signals read off the replayed series ---------------------------------------


def signal_expr(name: str) -> C.Expr | None:
    """How a signal is read from series (None: no series holds it)."""
    signal = SIGNALS.get(name)
    if signal is None:
        return None
    if signal.metric is not None and signal.type in ("gauge", "counter"):  # a counter: as is
        inst: C.Expr = C.Instant(C.Selector(signal))
        return C.Reduce("max", signal.per, inst) if signal.per else inst
    base = SIGNALS.get(signal.of) if signal.of else None
    if base is None or base.metric is None:
        return None
    sel = C.Selector(base)
    match signal.how:
        case "per_second" | "per_minute":
            return C.Rate(sel, SIGNAL_WINDOW)
        case "p99":
            return C.Quantile(0.99, sel, SIGNAL_WINDOW)
        case "max" | "spread" if base.per:
            return C.Reduce(signal.how, base.per, C.Instant(sel))
        case str(value) if base.per and value not in ("sum", "count", "spread_ratio"):
            return C.Instant(C.Selector(base, ((base.per, value),)))
    return None


def _scale(name: str) -> float:
    return 60.0 if name.endswith("_per_minute") else 1.0


def readable(name: str) -> bool:
    return name in COMPUTED or signal_expr(name) is not None


# -- the replay ----------------------------------------------------------------------


@dataclass
class Finding:
    """One firing episode of one rule on one engine."""

    alert: str
    severity: str
    runbook: str | None
    engine: EngineKey
    labels: dict[str, str]
    pending_at: float
    fired_at: float
    value: float
    resolved_at: float | None = None
    peak: float = -math.inf

    @property
    def engine_name(self) -> str:
        return "/".join(self.engine)


Observer = Callable[[float, list[IncidentEvent]], None]


@dataclass
class Replay:
    """The embedded evaluator, run over recorded samples instead of scrapes."""

    rules: Sequence[Rule]
    left_open: bool = True
    signals: Iterable[str] = ()  # read besides the rules' series (checks, knobs)
    series: Iterable[str] = ()  # raw series kept besides (read with `latest`)
    history: float = 0.0  # seconds of the extra signals' series kept at least
    store: WindowStore = field(init=False)
    evaluator: Evaluator = field(init=False)
    findings: list[Finding] = field(default_factory=list)
    open: dict[tuple[str, str, EngineKey], Finding] = field(default_factory=dict)
    evaluations: int = 0

    def __post_init__(self) -> None:
        self.store = store_for_rules(self.rules, left_open=self.left_open, slack=SLACK)
        self.events: list[IncidentEvent] = []
        self._first: dict[EngineKey, float] = {}  # each engine's first sample
        self.evaluator = Evaluator(self.rules, self.store, self, clock=lambda: 0.0)
        self._compiler = Compiler(self.store)
        self._reads: dict[str, Fn] = {}
        wanted = set(self.signals)
        raw = set(self.series)
        for computed in [n for n in wanted if n in COMPUTED]:
            raw |= set(COMPUTED[computed])
        for name in sorted(wanted):
            expr = signal_expr(name)
            if expr is not None:
                self._keep(expr)
                self._reads[name] = self._compiler.expr(expr)
        for name in sorted(raw):
            self._keep_name(name, self.store.lookback)

    def _keep(self, expr: C.Expr) -> None:
        """The store keeps what `expr` reads, whatever the rules' matchers."""
        for leaf, offset in C.leaves(expr):
            name, span = leaf.sel.metric, self.store.lookback
            match leaf:
                case C.Rate(_, window):
                    span = window
                    self.store.counters.add(name)
                case C.Quantile(_, _, window):
                    name, span = name + "_bucket", window
                    self.store.counters.add(name)
            self._keep_name(name, span + offset)

    def _keep_name(self, name: str, span: float) -> None:
        keep = max(span, self.history) + SLACK
        self.store.retention[name] = max(self.store.retention.get(name, 0.0), keep)
        self.store.only.pop(name, None)

    @property
    def names(self) -> list[str]:
        """The series names to read."""
        return sorted(self.store.retention)

    @property
    def reach(self) -> float:
        """Seconds before the range's start whose samples the first evaluation reads."""
        return max(self.store.retention.values())

    # IncidentSink
    def record(self, event: IncidentEvent) -> None:
        self.events.append(event)
        key = (event.alert, event.severity, event.engine)
        if event.state == "firing":
            finding = Finding(
                event.alert,
                event.severity,
                event.runbook,
                event.engine,
                dict(event.labels),
                event.first_seen,
                event.at,
                event.value,
                peak=event.value,
            )
            self.open[key] = finding
            self.findings.append(finding)
        elif event.state == "resolved" and key in self.open:
            self.open.pop(key).resolved_at = event.at

    def ingest(self, name: str, labels: Mapping[str, str], values: list[list[Any]]) -> None:
        rest = {k: v for k, v in labels.items() if k not in ("__name__", "instance")}
        instance = labels.get("instance", "")
        series = self.store.add(instance, name, rest, float(values[0][0]), float(values[0][1]))
        if series is None:
            return
        key = (instance, rest["model_name"], rest["engine"])
        eng = self.store.engines[key]
        first = float(values[0][0])
        if first < self._first.get(key, math.inf):
            self._first[key] = first
        for t, v in values[1:]:
            series.append(float(t), float(v))
        if series.ts and series.ts[-1] > eng.last_ts:
            eng.last_ts = series.ts[-1]

    def evaluate(self, now: float) -> list[IncidentEvent]:
        self.evaluations += 1
        before = len(self.events)
        # An engine whose first sample is still ahead (read with its chunk) is not
        # there yet: the service would not have scraped it (nor call it plugin-less).
        engines = self.store.engines
        later = {k: engines.pop(k) for k, t in self._first.items() if t > now and k in engines}
        try:
            self.evaluator.evaluate(now)
        finally:
            engines.update(later)
        for (i, engine), alert in self.evaluator.active.items():
            if alert.state == "firing":
                finding = self.open.get((self.rules[i].alert, self.rules[i].severity, engine))
                if finding is not None and alert.value > finding.peak:
                    finding.peak = alert.value
        return self.events[before:]

    def read(self, engine: EngineKey, name: str, t: float) -> float | None:
        """A signal's value on `engine` at `t` (None: not recorded, or no value then)."""
        eng = self.store.engines.get(engine)
        if eng is None:
            return None
        cache: Cache = {}
        if name in COMPUTED:
            parts = [self.latest(engine, n, t) for n in COMPUTED[name]]
            if any(p is None for p in parts):
                return None
            used, free, running = (int(p) for p in parts if p is not None)
            return kv_capacity_seqs(used, free, running)
        fn = self._reads.get(name)
        if fn is None:
            return None
        value = fn(eng, t, cache)
        if isinstance(value, dict):
            value = max(value.values(), default=None)
        return None if value is None or math.isnan(value) else value * _scale(name)

    def latest(self, engine: EngineKey, series: str, t: float) -> float | None:
        """A raw series' newest value at `t` (the first, if the engine has several)."""
        eng = self.store.engines.get(engine)
        for s in eng.by_name.get(series, ()) if eng is not None else ():
            value = self.store.latest(s, t)
            if value is not None:
                return value
        return None

    def engines(self) -> list[EngineKey]:
        return sorted(self.store.engines)


def steps(start: float, end: float, step: float) -> list[float]:
    n = math.floor((end - start) / step + 1e-9)
    return [start + i * step for i in range(n + 1)]


def run(
    replay: Replay,
    source: PrometheusRange,
    start: float,
    end: float,
    step: float,
    *,
    chunk: float = CHUNK_SECONDS,
    observer: Observer | None = None,
) -> Replay:
    """Read (start - history, end] chunk by chunk and evaluate at every step."""
    if not end > start:
        raise BacktestError("the range's end must be after its start")
    if step <= 0:
        raise BacktestError("the step must be positive")
    chunk = max(chunk, step)
    times = steps(start, end, step)
    names = replay.names

    async def go() -> None:
        fetcher = source._fetcher()
        try:
            lo = start - replay.reach
            i = 0
            while lo < end:
                hi = min(lo + chunk, end)
                for name, labels, values in await source.chunk(fetcher, names, lo, hi):
                    if values:
                        replay.ingest(name, labels, values)
                while i < len(times) and times[i] <= hi:
                    events = replay.evaluate(times[i])
                    if observer is not None:
                        observer(times[i], events)
                    i += 1
                lo = hi
        finally:
            await fetcher.aclose()

    asyncio.run(go())
    return replay


def parse_time(text: str, now: float) -> float:
    """UNIX seconds, RFC 3339 (2026-12-05T10:00:00Z), `now` or `now-2h`."""
    from datetime import datetime

    from vllm_runbook.rules.durations import parse_duration

    text = text.strip()
    if text == "now":
        return now
    if text.startswith("now-"):
        return now - parse_duration(text[4:])
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise BacktestError(
            f"not a time: {text!r} (UNIX seconds, RFC 3339 or now-DURATION)"
        ) from None
    if moment.tzinfo is None:
        raise BacktestError(f"a time needs its zone: {text!r} (e.g. {text}Z)")
    return moment.timestamp()

"""Scraper: Prometheus text exposition from engine endpoints into the WindowStore.

A cycle scrapes every due target concurrently (at most `concurrency` requests
in flight, on the scraper's event loop), each within its own `timeout` (the
whole request: connect, headers and body), so a cycle costs about its
slowest target, not the sum. A target that does not answer
(refused, timed out) is backed off: skipped for `backoff.delay(n)` seconds
after its n-th failure in a row (doubling, capped), then tried again, so a
dead engine does not add its timeout to every cycle. A target that answers
non-200 or sends text that does not parse costs nothing and is tried every
cycle.

Every failed attempt is counted (`error_counts`, and the `on_error(target_url,
reason)` callback the service injects: `runbook serve` exports it as
``vllm_runbook_service_scrape_errors_total{target,reason}``), logged once per
change of state, and the target's series go
stale; the scrape loop itself never raises for a target's fault. Whether each
target's latest attempt worked is kept in `up` (not exported: Prometheus has
its own `up` for the targets it scrapes). An optional `observer` hears of
every attempt (its duration) and of every cycle.

A target that hangs does not hold the cycle: with a `deadline` (seconds
after the cycle starts) and a `grace` (once every request is sent and 90 %
of them answered, seconds without an answer), the cycle stops waiting at
whichever comes first (`runbook serve`: rules.scrape_deadline x the
interval, rules.scrape_grace). The targets still in flight then are
`late`, not failed: their requests go on,
on the scraper's loop (a thread of the scraper drives it between cycles,
only while such a request is in flight, and only fetches), each within its
own `timeout`. An answer that comes is ingested at the next cycle (or when
it comes, during one) with the time of the cycle that asked for it, so the
windows hold it where it belongs; a late target is not asked again before
its answer or its timeout. One whose timeout passes is a failure, counted
and backed off as any other. Without a deadline or a grace a cycle waits
for every target (each within its timeout).

HTTP is vllm_runbook.rules.fetch (aiohttp's client, one pooled session, one
kept-alive connection per target; the choice is measured there).

The scraper has no thread of its own but that one: `scrape_once` runs the
scraper's event loop in the calling thread (in `runbook serve`, the rules'
cycle, a job of the service's one scheduler: rules/scheduling.py,
service/leader.py) until the cycle's requests are done (or it stops
waiting). The loop, its session and the kept-alive connections outlive the
call, idle between cycles (but for late requests), so every target's
connection is reused by the next cycle whichever pool thread runs it. One
cycle at a time drives the loop (a second caller waits); call it from a
thread that runs no event loop of its own.

Each request asks only for the sample names some bound rule reads
(`?name[]=...`, the filter prometheus_client's exposition honours): the
collector agent's /metrics then sends the ~20 samples the catalog reads of
it (6 of its 27 KiB). vLLM's own /metrics (0.32) ignores the filter (its
instrumentator's route answers before prometheus_client's app) and sends its
whole page, which the parse below reads as before. A target that refuses the
filter (HTTP 400, 404, 405, 414, 422 or 431 to the filtered URL) is asked
again without it in the same attempt. An answer with a metric family that no
wanted name belongs to (a `# TYPE` line: a filter sends only the families it
matched) is a whole page: the filter was ignored, and the target is asked for
its whole page from then on (`unfiltered`), with no second request. Otherwise,
at a target's first answer, and every CHECK_FILTER_EVERY attempts after (each
target at its own phase, so that a fleet started at once does not check in
the same cycle again), its whole page is read too: a target that refused the
filter, or whose whole page has series the rules read that its filtered one
lacks (prometheus_client's multiprocess registry finds no collector by name
and answers the filter with an empty page), is `unfiltered` from then on.

The parse never splits the text into metric families: one regular expression
(the wanted names as a trie, anchored after a newline) finds the lines whose
sample name some bound rule reads (`WindowStore.retention`, derived from the
rules), and only those are read. vLLM's `/metrics` has ~550 lines of which the
catalog reads ~30. A series already seen on a target is appended to directly,
keyed by its name and the text of its labels.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import math
import re
import threading
import time
import zlib
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar
from urllib.parse import quote

from vllm_runbook.rules.fetch import Fetcher, FetchError
from vllm_runbook.rules.window import EngineSeries, Series, WindowStore

log = logging.getLogger(__name__)

T = TypeVar("T")

UNREACHABLE, HTTP_STATUS, PARSE = "unreachable", "http_status", "parse"
BACKOFF = "backoff"  # not attempted this cycle (not an error: nothing was tried)
LATE = "late"  # still in flight when the cycle stopped waiting (not an error)


@dataclass(frozen=True)
class Target:
    url: str  # e.g. http://127.0.0.1:8000/metrics
    instance: str  # the engine's name in the inventory: its `instance` label


@dataclass(frozen=True)
class ScrapeResult:
    target: Target
    ok: bool
    samples: int = 0
    error: str | None = None  # one line: what went wrong
    reason: str | None = None  # unreachable | http_status | parse | backoff (skipped)
    seconds: float = 0.0  # wall time of the attempt (0 when skipped)
    parse_seconds: float = 0.0  # of which parsing and storing the samples
    late: bool = False  # the answer of an earlier cycle's request, settled after it ended


@dataclass(frozen=True)
class ScrapeCycle:
    """One `scrape_once`: wall time, and how its targets fared."""

    seconds: float
    parse_seconds: float  # summed over the targets (one thread parses)
    attempted: int
    failed: int
    skipped: int  # backed off
    late: int = 0  # still in flight at the cycle's end (sent by it or an earlier one)


@dataclass(frozen=True)
class Backoff:
    """Seconds a target that does not answer is skipped after its n-th failure in a row:
    base, 2 x base, 4 x base, ... at most `cap`. base 0: never skipped."""

    base: float = 10.0
    cap: float = 120.0

    def delay(self, failures: int) -> float:
        if failures <= 0 or self.base <= 0:
            return 0.0
        return min(self.cap, self.base * 2.0 ** (failures - 1))


NO_BACKOFF = Backoff(base=0.0)


class ScrapeObserver(Protocol):
    """What the service hears from the scraper (its metrics; the scraper imports none)."""

    def target_scraped(self, result: ScrapeResult) -> None:
        """After every attempt, failed or not (not for a target skipped in backoff)."""

    def cycle_scraped(self, cycle: ScrapeCycle) -> None:
        """After every `scrape_once`."""


@dataclass
class _TargetState:
    failures: int = 0  # unanswered attempts in a row
    retry_at: float = -math.inf
    attempts: int = 0
    # the attempt that last compared the filtered and the whole page, plus a phase of
    # the target's own (so that a fleet's checks spread over the cycles); None: never
    checked_at: int | None = None


@dataclass
class _Fetched:
    status: int | None = None
    text: str = ""
    reason: str | None = None
    error: str | None = None
    seconds: float = 0.0


@dataclass
class _Run:
    """One cycle's requests while it waits for them (on the loop)."""

    now: float
    total: int
    done: asyncio.Event
    results: dict[Target, ScrapeResult]
    sent: int = 0
    last: float = 0.0  # loop time of the latest request sent or answer received
    open: bool = True  # False: the cycle stopped waiting; answers from now on are late
    error: Exception | None = None  # a request that raised (a bug): the cycle raises it


class Scraper:
    def __init__(
        self,
        store: WindowStore,
        targets: Sequence[Target],
        *,
        timeout: float = 5.0,
        concurrency: int = 32,
        backoff: Backoff = Backoff(),
        on_error: Callable[[str, str], None] | None = None,
        observer: ScrapeObserver | None = None,
        clock: Callable[[], float] = time.time,
        filter_names: bool = True,
        deadline: float | None = None,
        grace: float | None = None,
    ) -> None:
        """`on_error(target_url, reason)` is called for each failed attempt (the
        service counts them into its exported metric); `error_counts` keeps the
        same counts by (target URL, reason) in any case. `observer` hears of every
        attempt and cycle (the service's metrics). `filter_names`: ask each target
        for the wanted sample names only (False: always the whole page). `deadline`:
        seconds after its start a cycle stops waiting for its targets; `grace`: once
        every request is sent and GRACE_AFTER of them answered, seconds without an
        answer after which it stops waiting (None: no such limit). The targets still
        in flight then are late."""
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        for name, value in (("deadline", deadline), ("grace", grace)):
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        self.store = store
        self.targets = list(targets)
        self.timeout = timeout
        self.concurrency = concurrency
        self.backoff = backoff
        self.deadline = deadline
        self.grace = grace
        # Every target keeps its connection between cycles (Prometheus does the same).
        self.client = Fetcher()
        self.clock = clock
        self.on_error = on_error
        self.error_counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.observer = observer
        self.up: dict[str, bool] = {}  # target URL -> whether its latest attempt worked
        self.state: dict[str, _TargetState] = {t.url: _TargetState() for t in self.targets}
        self.last_cycle: ScrapeCycle | None = None
        self._failing: dict[str, str] = {}
        self._lines = _line_finder(store)
        self._query = wanted_query(store) if filter_names else ""
        self._families = wanted_families(store)
        self.unfiltered: set[str] = set()  # target URLs that refused the filter
        # target URL -> (name, labels text) -> (series, its engine, the engine's version)
        self._known: dict[str, dict[tuple[str, str], tuple[Series, EngineSeries, int]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cycle = threading.Lock()  # one caller at a time runs the loop
        self._state = threading.Lock()  # guards _loop, _running, _close_after
        self._running = False
        self._close_after = False  # close() came while a cycle ran: it closes the loop
        # Late requests: target URL -> its request, still in flight after its cycle;
        # answers that came while no cycle ran (target, its state, answer, asked at).
        self._inflight: dict[str, asyncio.Task[None]] = {}
        self._late: list[tuple[Target, _TargetState, _Fetched, float]] = []
        self._drainer: threading.Thread | None = None  # drives the loop between cycles
        self._draining = False  # read and cleared on the loop's thread
        self._late_results: dict[Target, ScrapeResult] = {}  # settled during this cycle

    def set_targets(self, targets: Sequence[Target]) -> list[Target]:
        """Scrape `targets` from the next cycle on (the inventory changed). A target
        no longer there is forgotten: its backoff, its connection, its series (its
        engine's alerts resolve). Returns the targets removed. Call between cycles."""
        new = list(targets)
        urls = {t.url for t in new}
        removed = [t for t in self.targets if t.url not in urls]
        self.targets = new
        for target in new:
            self.state.setdefault(target.url, _TargetState())
        instances = {t.instance for t in new}
        for target in removed:
            self.state.pop(target.url, None)
            self.up.pop(target.url, None)
            self._failing.pop(target.url, None)
            self._known.pop(target.url, None)
            self.unfiltered.discard(target.url)
            self.client.forget(target.url)  # between cycles: the loop is idle
            if target.instance not in instances:
                self.store.forget(target.instance, [t.url for t in removed])
        return removed

    # -- the cycle ---------------------------------------------------------------
    def scrape_once(self, now: float | None = None) -> list[ScrapeResult]:
        """Scrape every due target (concurrently); one result per target, in order."""
        now = self.clock() if now is None else now
        started = time.perf_counter()
        scraped, attempted = self._run(self._scrape_all(now))
        results = [scraped.get(t) or self._skipped(t) for t in self.targets]
        late = sum(1 for r in results if r.reason == LATE)
        cycle = ScrapeCycle(
            seconds=time.perf_counter() - started,
            parse_seconds=sum(r.parse_seconds for r in results),
            attempted=attempted,
            failed=sum(1 for r in results if not r.ok and r.reason not in (BACKOFF, LATE)),
            skipped=sum(1 for r in results if r.reason == BACKOFF),
            late=late,
        )
        self.last_cycle = cycle
        if self.observer is not None:
            self.observer.cycle_scraped(cycle)
        return results

    async def _scrape_all(self, now: float) -> tuple[dict[Target, ScrapeResult], int]:
        """This cycle's results by target (a late one: LATE), and how many it asked."""
        late, self._late = self._late, []
        self._late_results = {}
        for target, state, fetched, asked in late:  # answered between cycles
            if self.state.get(target.url) is state:  # still a target
                self._late_results[target] = self._settle(target, fetched, asked, late=True)
        due = [
            t
            for t in self.targets
            if now >= self.state[t.url].retry_at and t.url not in self._inflight
        ]
        loop = asyncio.get_running_loop()
        run = _Run(now, len(due), asyncio.Event(), {}, last=loop.time())
        limit = asyncio.Semaphore(self.concurrency)

        async def one(target: Target, state: _TargetState) -> None:
            try:
                async with limit:
                    run.sent += 1
                    run.last = loop.time()
                    fetched = await self._fetch(target)
                self._answered(target, state, fetched, run)
            except Exception as exc:  # not a target's fault: the cycle raises it
                if run.open and run.error is None:
                    run.error = exc
                    run.done.set()
                raise

        tasks = [(t, loop.create_task(one(t, self.state[t.url]))) for t in due]
        if due:
            await self._wait(run)
        run.open = False
        if run.error is not None:
            raise run.error
        for target, task in tasks:
            if target not in run.results:
                self._inflight[target.url] = task
        results = run.results
        for target in self.targets:
            if target.url in self._inflight:
                results[target] = ScrapeResult(
                    target, False, error="its answer is awaited (late)", reason=LATE
                )
            elif target not in results and target in self._late_results:
                results[target] = self._late_results[target]  # not asked again yet
        return results, len(due)

    async def _wait(self, run: _Run) -> None:
        """Until every request of `run` is answered, its deadline or its grace."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        while not run.done.is_set():
            until = math.inf if self.deadline is None else start + self.deadline
            if self.grace is not None:
                # Every request sent and GRACE_AFTER of them answered: silence for
                # `grace` ends the wait; before, look again every `grace`.
                answered = len(run.results) >= GRACE_AFTER * run.total
                last = run.last if run.sent == run.total and answered else loop.time()
                until = min(until, last + self.grace)
            left = until - loop.time()
            if left <= 0:
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(None if math.isinf(left) else left):
                    await run.done.wait()

    def _answered(self, target: Target, state: _TargetState, fetched: _Fetched, run: _Run) -> None:
        """On the loop's thread: settle an answer now (its cycle, or a later one,
        runs the loop: one writer of the store) or keep it for the next cycle."""
        if run.open:
            # Parsed on the loop thread, one target at a time: the store has one writer.
            run.results[target] = self._settle(target, fetched, run.now)
            run.last = asyncio.get_running_loop().time()
            if len(run.results) == run.total:
                run.done.set()
            return
        if self._inflight.get(target.url) is asyncio.current_task():
            del self._inflight[target.url]
        if self.state.get(target.url) is not state:
            return  # no longer a target (set_targets): forgotten
        if self._draining:  # between cycles: the next one settles it
            self._late.append((target, state, fetched, run.now))
            if not self._inflight:
                self._stop_draining()
        else:
            self._late_results[target] = self._settle(target, fetched, run.now, late=True)

    async def _fetch(self, target: Target) -> _Fetched:
        started = time.perf_counter()
        out = _Fetched()
        try:
            async with asyncio.timeout(self.timeout):
                out.status, out.text = await self._get(target)
        except TimeoutError:
            out.reason, out.error = UNREACHABLE, f"no answer within {self.timeout:g} s"
        except (OSError, EOFError, ValueError, asyncio.LimitOverrunError, FetchError) as exc:
            out.reason, out.error = UNREACHABLE, f"{type(exc).__name__}: {exc}"
        out.seconds = time.perf_counter() - started
        return out

    async def _get(self, target: Target) -> tuple[int, str]:
        url = target.url
        if not self._query or url in self.unfiltered:
            return await self._get_text(url)
        status, text = await self._get_text(self.filtered_url(url))
        state = self.state.setdefault(url, _TargetState())
        check = state.checked_at is None or state.attempts - state.checked_at >= CHECK_FILTER_EVERY
        if status == 200 and check and self._ignores_filter(text):
            # A family no wanted name belongs to: the filter was not applied, this is
            # the whole page (vLLM's own /metrics): no second request, now or later.
            self.unfiltered.add(url)
            log.info("%s ignores name[]= filters: its whole page", url)
            return status, text
        if status in FILTER_REFUSED or (status == 200 and check):
            # Refused, or time to check (a target's first answer, then every
            # CHECK_FILTER_EVERY attempts): the whole page too, and if the filter
            # was refused or lost series the rules read (prometheus_client's
            # multiprocess registry answers it with an empty page), the whole page
            # from now on.
            whole_status, whole = await self._get_text(url)
            if whole_status == 200:
                # the first check sets the target's phase (its second check comes
                # CHECK_FILTER_EVERY + phase attempts later): a fleet started at
                # once does not read every whole page again in the same cycle
                phase = 0 if state.checked_at is not None else _phase(url)
                state.checked_at = state.attempts + phase
                if status != 200 or self._wanted(whole) - self._wanted(text):
                    self.unfiltered.add(url)
                    log.info("%s does not answer name[]= filters: its whole page", url)
                    return whole_status, whole
            if status != 200:
                return whole_status, whole
        return status, text

    def _ignores_filter(self, text: str) -> bool:
        """Whether `text`, the answer to the filtered URL, has a metric family that no
        wanted sample name belongs to (a filter sends only families it matched)."""
        return any(m.group(1) not in self._families for m in _TYPE_LINE.finditer(text))

    async def _get_text(self, url: str) -> tuple[int, str]:
        status, body = await self.client.get(url)
        return status, body.decode("utf-8", "replace")

    def _wanted(self, text: str) -> set[str]:
        return {m.group(1) for m in self._lines.finditer("\n" + text)}

    def filtered_url(self, url: str) -> str:
        """`url` asking for the wanted sample names only."""
        return url + ("&" if "?" in url else "?") + self._query

    def _settle(
        self, target: Target, fetched: _Fetched, now: float, *, late: bool = False
    ) -> ScrapeResult:
        state = self.state.setdefault(target.url, _TargetState())
        state.attempts += 1
        if fetched.reason is not None:
            state.failures += 1
            state.retry_at = now + self.backoff.delay(state.failures)
            result = self._failed(target, now, fetched.reason, fetched.error or "", fetched.seconds)
        else:
            state.failures, state.retry_at = 0, -math.inf
            result = self._ingest_response(target, fetched, now)
        if late:
            result = dataclasses.replace(result, late=True)
        if self.observer is not None:
            self.observer.target_scraped(result)
        return result

    def _ingest_response(self, target: Target, fetched: _Fetched, now: float) -> ScrapeResult:
        if fetched.status != 200:
            return self._failed(target, now, HTTP_STATUS, f"HTTP {fetched.status}", fetched.seconds)
        started = time.perf_counter()
        seen: set[Series] = set()
        try:
            count = self.ingest(target, fetched.text, now, seen)
        except ExpositionError as exc:
            parse = time.perf_counter() - started
            return self._failed(
                target, now, PARSE, f"unparsable exposition: {exc}", fetched.seconds + parse, parse
            )
        self.store.end_scrape(target.url, now, seen)
        parse = time.perf_counter() - started
        self.up[target.url] = True
        if self._failing.pop(target.url, None) is not None:
            log.info("scrape of %s (%s) works again", target.url, target.instance)
        seconds = fetched.seconds + parse
        return ScrapeResult(target, True, count, seconds=seconds, parse_seconds=parse)

    def ingest(self, target: Target, text: str, now: float, seen: set[Series]) -> int:
        """Parse `text`; store only the series some rule reads. Returns samples stored.
        ExpositionError (nothing stored) when a wanted line does not parse.

        A series seen before on this target is appended to directly (looked up by
        its name and the text of its labels): no label parsing, no store look-up,
        unless its engine gained or lost a series since (EngineSeries.version)."""
        samples = raw_samples(text, self._lines)
        known = self._known.setdefault(target.url, {})
        if len(known) > 2 * len(samples) + 64:
            known.clear()  # series that went away: forget them
        fresh: list[tuple[str, str, dict[str, str], float]] = []
        hits: list[tuple[Series, EngineSeries, float]] = []
        for name, block, value in samples:  # nothing stored before all parsed
            hit = known.get((name, block))
            if hit is not None and hit[1].version == hit[2]:
                hits.append((hit[0], hit[1], value))
            else:
                labels = _labels(block[1:-1], name + block) if block else {}
                fresh.append((name, block, labels, value))
        for series, engine, value in hits:
            series.append(now, value)
            if now > engine.last_ts:
                engine.last_ts = now
            seen.add(series)
        count = len(hits)
        for name, block, labels, value in fresh:
            added = self.store.add(target.instance, name, labels, now, value, seen)
            if added is None:
                continue
            count += 1
            engine = self.store.engines[(target.instance, labels["model_name"], labels["engine"])]
            known[(name, block)] = (added, engine, engine.version)
        return count

    def _skipped(self, target: Target) -> ScrapeResult:
        state = self.state[target.url]
        return ScrapeResult(
            target,
            False,
            error=f"backing off after {state.failures} failed attempts; next at {state.retry_at:g}",
            reason=BACKOFF,
        )

    def _failed(
        self,
        target: Target,
        now: float,
        reason: str,
        error: str,
        seconds: float,
        parse_seconds: float = 0.0,
    ) -> ScrapeResult:
        self.error_counts[(target.url, reason)] += 1
        if self.on_error is not None:
            self.on_error(target.url, reason)
        self.up[target.url] = False
        self.store.mark_source_down(target.url, now)
        if self._failing.get(target.url) != error:
            log.warning("scrape of %s (%s) failed: %s", target.url, target.instance, error)
        self._failing[target.url] = error
        return ScrapeResult(
            target, False, error=error, reason=reason, seconds=seconds, parse_seconds=parse_seconds
        )

    # -- the event loop, run by the calling thread -------------------------------------
    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """`coro` on the scraper's loop, run in this thread until it is done."""
        with self._cycle:
            with self._state:
                self._pause()  # this thread drives the loop now
                if self._loop is None:
                    self._loop = asyncio.new_event_loop()
                loop, self._running = self._loop, True
            try:
                return loop.run_until_complete(coro)
            finally:
                with self._state:
                    self._running = False
                    closing, self._close_after = self._close_after, False
                    if closing:
                        self._loop = None
                    elif self._inflight:
                        self._resume(loop)
                if closing:
                    self._close_loop(loop)

    def _resume(self, loop: asyncio.AbstractEventLoop) -> None:
        """Late requests in flight: a thread drives the loop until they are done
        or the next cycle (or close) takes it back. Under _state."""
        self._draining = True
        self._drainer = threading.Thread(
            target=loop.run_forever, name="vllm-runbook-scrape-late", daemon=True
        )
        self._drainer.start()

    def _pause(self) -> None:
        """Take the loop back from the thread that drives it between cycles. Under _state."""
        thread, self._drainer = self._drainer, None
        if thread is None:
            return
        assert self._loop is not None
        # Run by the loop: it stops it if that thread still drives it (a no-op
        # when the late requests were done first and it stopped by itself).
        self._loop.call_soon_threadsafe(self._stop_draining)
        thread.join()
        self._draining = False

    def _stop_draining(self) -> None:
        if self._draining:
            self._draining = False
            asyncio.get_running_loop().stop()

    def close(self) -> None:
        """Close the connections and the event loop (idempotent; a later scrape
        opens new ones). During a cycle (a stop that gave up waiting for it) the
        cycle closes them when it ends."""
        with self._state:
            if self._running:
                self._close_after = True
                return
            self._pause()
            loop, self._loop = self._loop, None
        if loop is not None:
            self._close_loop(loop)

    def _close_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        late, self._late = list(self._inflight.values()), []
        self._inflight.clear()  # never answered: asked again by the next cycle
        for task in late:
            task.cancel()
        with contextlib.suppress(Exception):  # its connections; the loop closes anyway
            if late:
                loop.run_until_complete(asyncio.gather(*late, return_exceptions=True))
            loop.run_until_complete(asyncio.wait_for(self.client.aclose(), 5))
        loop.close()

    def __enter__(self) -> Scraper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the exposition parse ------------------------------------------------------------


class ExpositionError(ValueError):
    """A line the rules need does not parse."""


# name{labels} value [timestamp]; a label value may hold any escaped character. What
# follows the name on a line: the labels block (group), the value (group), the end.
_SAMPLE_REST = (
    r'(\{(?:[^"}\n]++|"(?:[^"\\\n]++|\\.)*+")*+\})?[ \t]+(\S+)(?:[ \t]+-?\d+)?[ \t]*\r?(?=\n|\Z)'
)
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\\n]|\\.)*)"[ \t]*(,|$)')
_UNESCAPE = re.compile(r"\\(.)")
_TYPE_LINE = re.compile(r"^# TYPE (\S+)", re.MULTILINE)
_ESCAPES = {"n": "\n", "\\": "\\", '"': '"'}


# What an endpoint that does not take `name[]` may answer to it (then: the whole page).
FILTER_REFUSED = frozenset({400, 404, 405, 414, 422, 431})
# A cycle's `grace` applies once this share of its requests is answered: the few left
# are stragglers (a cycle of a few targets waits for them, up to its deadline).
GRACE_AFTER = 0.9
# Every this many attempts (and at a target's first answer) the whole page is read
# too, to check that the filter loses nothing the rules read (10 min at 5 s).
CHECK_FILTER_EVERY = 120


def _phase(url: str) -> int:
    """A target's own offset among CHECK_FILTER_EVERY attempts (stable across restarts)."""
    return zlib.crc32(url.encode()) % CHECK_FILTER_EVERY


def wanted_families(store: WindowStore) -> frozenset[str]:
    """The metric family names a wanted sample name may belong to: the name itself
    and every prefix of it that ends before an underscore (`x` of `x_bucket`)."""
    out = set()
    for name in store.retention:
        out.add(name)
        out.update(name[:i] for i, ch in enumerate(name) if ch == "_")
    return frozenset(out)


def wanted_query(store: WindowStore) -> str:
    """The query string asking for the sample names the store keeps (prometheus_client's
    exposition filter: repeated `name[]`, matched against sample names)."""
    return "&".join(f"name[]={quote(name, safe='')}" for name in sorted(store.retention))


def _line_finder(store: WindowStore) -> re.Pattern[str]:
    """A newline, a sample name the store keeps, then that line read as a sample:
    groups (name, labels block or None, value, None), or (name, None, None, the rest
    of the line) for a line that does not parse. The names are one trie-shaped
    alternation: the regex engine jumps from newline to newline (a literal prefix)
    and rejects most lines on their first characters."""
    names = list(store.retention)
    if not names:
        return re.compile(r"(?!)")
    return re.compile(rf"\n({_trie(names)})(?:{_SAMPLE_REST}|(?=[{{ \t])([^\n]*))")


def _trie(words: list[str]) -> str:
    tree: dict[str, Any] = {}
    for word in words:
        node = tree
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}  # a word ends here

    def walk(node: dict[str, Any]) -> str:
        branches = [re.escape(ch) + walk(child) for ch, child in sorted(node.items()) if ch]
        if not branches:
            return ""
        group = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return f"(?:{group})?" if "" in node else group

    return walk(tree)


def raw_samples(text: str, lines: re.Pattern[str]) -> list[tuple[str, str, float]]:
    """(name, labels block as written, value) of every sample on the lines `lines`
    finds; the rest of the text (comments, other families) is skipped unparsed.
    ExpositionError on the first wanted line that does not parse (the inside of the
    labels block is checked by `_labels`, which the caller runs on a block it has not
    seen before). One regular expression reads each line: no second match per line."""
    out: list[tuple[str, str, float]] = []
    append = out.append
    for name, block, value, bad in lines.findall("\n" + text):
        if value:
            try:
                append((name, block, float(value)))
                continue
            except ValueError:
                raise ExpositionError(
                    f"bad value in line: {name + block + ' ' + value!r}"
                ) from None
        raise ExpositionError(f"bad sample line: {name + bad[:200]!r}")
    return out


def parse_wanted(text: str, lines: re.Pattern[str]) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample `raw_samples` finds."""
    return [
        (name, _labels(block[1:-1], name + block) if block else {}, value)
        for name, block, value in raw_samples(text, lines)
    ]


def _labels(inner: str, line: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    pos, end = 0, len(inner)
    while pos < end:
        m = _LABEL.match(inner, pos)
        if m is None:
            if inner[pos:].strip(" \t,") == "":
                break
            raise ExpositionError(f"bad labels in line: {line[:200]!r}")
        value = m.group(2)
        labels[m.group(1)] = _UNESCAPE.sub(_unescape, value) if "\\" in value else value
        pos = m.end()
        if not m.group(3):
            break
    return labels


def _unescape(m: re.Match[str]) -> str:
    return _ESCAPES.get(m.group(1), m.group(0))

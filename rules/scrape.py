"""Scraper: Prometheus text exposition from engine endpoints into the WindowStore.

A target that cannot be reached, answers non-200 or sends text that does not
parse is counted (`error_counts`, and the `on_error(target_url, reason)`
callback the service injects: `runbook serve` exports it as
``vllm_runbook_service_scrape_errors_total{target,reason}``), logged once
per change of state, and its series go stale; the scrape loop itself never
raises for a target's fault. Whether each target's latest scrape worked is
kept in `up` (not exported: Prometheus has its own `up` for the targets it
scrapes).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families
from vllm_runbook.rules.window import Series, WindowStore

log = logging.getLogger(__name__)


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
    reason: str | None = None  # unreachable | http_status | parse


class Scraper:
    def __init__(
        self,
        store: WindowStore,
        targets: Sequence[Target],
        *,
        client: httpx.Client | None = None,
        timeout: float = 5.0,
        on_error: Callable[[str, str], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`on_error(target_url, reason)` is called for each failed scrape (the
        service counts them into its exported metric); `error_counts` keeps
        the same counts by (target URL, reason) in any case."""
        self.store = store
        self.targets = list(targets)
        self.client = client or httpx.Client(timeout=timeout)
        self.clock = clock
        self.on_error = on_error
        self.error_counts: Counter[tuple[str, str]] = Counter()
        self.up: dict[str, bool] = {}  # target URL -> whether its latest scrape worked
        self._failing: dict[str, str] = {}

    def scrape_once(self, now: float | None = None) -> list[ScrapeResult]:
        now = self.clock() if now is None else now
        return [self.scrape_target(t, now) for t in self.targets]

    def scrape_target(self, target: Target, now: float) -> ScrapeResult:
        try:
            response = self.client.get(target.url)
        except httpx.HTTPError as exc:
            return self._failed(target, now, "unreachable", f"{type(exc).__name__}: {exc}")
        if response.status_code != 200:
            return self._failed(target, now, "http_status", f"HTTP {response.status_code}")
        try:
            seen: set[Series] = set()
            count = self.ingest(target, response.text, now, seen)
        except Exception as exc:
            return self._failed(target, now, "parse", f"unparsable exposition: {exc}")
        self.store.end_scrape(target.url, now, seen)
        self.up[target.url] = True
        if self._failing.pop(target.url, None) is not None:
            log.info("scrape of %s (%s) works again", target.url, target.instance)
        return ScrapeResult(target, True, count)

    def ingest(self, target: Target, text: str, now: float, seen: set[Series]) -> int:
        """Parse `text`; store only the series some rule reads. Returns samples stored."""
        count = 0
        for family in text_string_to_metric_families(_wanted_lines(text, self.store)):
            for sample in family.samples:
                if (
                    self.store.add(
                        target.instance, sample.name, sample.labels, now, float(sample.value), seen
                    )
                    is not None
                ):
                    count += 1
        return count

    def _failed(self, target: Target, now: float, reason: str, error: str) -> ScrapeResult:
        self.error_counts[(target.url, reason)] += 1
        if self.on_error is not None:
            self.on_error(target.url, reason)
        self.up[target.url] = False
        self.store.mark_source_down(target.url, now)
        if self._failing.get(target.url) != error:
            log.warning("scrape of %s (%s) failed: %s", target.url, target.instance, error)
        self._failing[target.url] = error
        return ScrapeResult(target, False, error=error, reason=reason)


def _wanted_lines(text: str, store: WindowStore) -> str:
    """Drop comments and unwanted series before parsing: vLLM's /metrics is long and
    the parser is pure Python. Without TYPE lines each sample keeps its own name."""
    keep = []
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        end = len(line)
        for sep in ("{", " "):
            i = line.find(sep)
            if 0 <= i < end:
                end = i
        if store.wants(line[:end]):
            keep.append(line)
    return "\n".join(keep) + "\n"

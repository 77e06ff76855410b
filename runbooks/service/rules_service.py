"""The embedded rules engine, wired from the configuration to the store in one place.

    config = load_config(path)                          # CatalogError if the file is broken
    service = RulesService.from_config(config, store=Journal(url), hook=executor_hook,
                                       runbooks=names)  # the deployed runbook catalog's
    service.start(scheduler)                            # scrape + evaluate every interval

`from_config` binds the whole catalog first and raises CatalogError with
every problem if any rule is broken (a `runbook` label outside `runbooks`,
default the shipped runbook catalog's names, included): the service refuses
to start rather than run with a rule silently dropped.

With `metrics` (the service's, vllm_runbook.runbooks.service.telemetry) each evaluation's
wall time, the scrape errors and durations per target and the firing incidents per alert
are exported.
Several replicas run the cycle through vllm_runbook.runbooks.service.leader: one at a
time (`rules.replicas: leader`), or each on its share of the engines (`split`): the
engines rendezvous hashing (`rendezvous_owner`) gives it among the live replicas
(`set_share`). An engine handed to another replica leaves this one's scrapes and
windows, and its open alerts are dropped without a resolve (the new owner
evaluates it from then on, through `for` again, as a new leader would).
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from apscheduler.job import Job
from apscheduler.schedulers.base import BaseScheduler
from vllm_runbook.rules.evaluator import Evaluator, store_for_rules
from vllm_runbook.rules.incidents import IncidentEvent, IncidentSink, MemoryIncidentSink
from vllm_runbook.rules.model import Rule
from vllm_runbook.rules.remediation import Dispatcher, RemediationHook
from vllm_runbook.rules.scheduling import schedule_cycle
from vllm_runbook.rules.scrape import Scraper
from vllm_runbook.rules.window import WindowStore
from vllm_runbook.runbooks.model.catalogs import load_rules, runbook_names
from vllm_runbook.runbooks.model.config import Config
from vllm_runbook.runbooks.service.discovery import Inventory
from vllm_runbook.runbooks.service.sql_sink import SqlIncidentSink
from vllm_runbook.runbooks.store import Journal

if TYPE_CHECKING:
    from vllm_runbook.runbooks.service.telemetry import ServiceMetrics


@dataclass
class RulesService:
    config: Config
    rules: list[Rule]
    windows: WindowStore
    scraper: Scraper
    evaluator: Evaluator
    dispatcher: Dispatcher
    recorder: SqlIncidentSink | MemoryIncidentSink
    clock: Callable[[], float] = time.time
    metrics: ServiceMetrics | None = None
    inventory: Inventory | None = None
    _inventory_version: int = -1
    _share: tuple[tuple[str, ...], str] | None = None  # (live replicas, this one)

    @classmethod
    def from_config(
        cls,
        config: Config,
        *,
        store: Journal | None = None,
        hook: RemediationHook | None = None,
        clock: Callable[[], float] = time.time,
        scrape_timeout: float = 5.0,
        metrics: ServiceMetrics | None = None,
        runbooks: Collection[str] | None = None,
        inventory: Inventory | None = None,
    ) -> RulesService:
        """Build everything; CatalogError (nothing built) when the catalog is broken.

        With a `store` incidents go to its incidents table; without one they
        stay in memory (tests, a dry look at a fleet). With an `inventory`
        (service/discovery.py) the engines are its own, re-read at every cycle:
        an engine discovered is scraped from the next cycle on, one that left is
        forgotten (its alerts resolve).
        """
        rules = load_rules(config, runbook_names() if runbooks is None else runbooks)
        windows = store_for_rules(rules)
        engines_now = inventory.engines() if inventory is not None else config.engines
        targets = [t for engine in engines_now for t in engine.targets()]
        scraper = Scraper(
            windows,
            targets,
            timeout=scrape_timeout,
            # A hanging target does not hold the cycle: late, not failed (rules/scrape.py).
            deadline=config.rules.scrape_deadline * config.evaluation_interval,
            grace=config.rules.scrape_grace,
            clock=clock,
            on_error=metrics.scrape_failed if metrics is not None else None,
            observer=metrics,
        )
        recorder: SqlIncidentSink | MemoryIncidentSink = (
            SqlIncidentSink(store, clock=clock) if store is not None else MemoryIncidentSink()
        )
        engines = {e.name: e for e in engines_now}
        dispatcher = Dispatcher([recorder], config.automation, hook, engines)
        evaluator = Evaluator(rules, windows, dispatcher, clock=clock)
        service = cls(
            config, rules, windows, scraper, evaluator, dispatcher, recorder, clock, metrics
        )
        service.inventory = inventory
        if inventory is not None:
            service._inventory_version = inventory.version
        return service

    @property
    def sink(self) -> IncidentSink:
        return self.dispatcher

    def run_cycle(self, now: float | None = None) -> list[IncidentEvent]:
        """Scrape every target, evaluate every rule, record and hand off the changes."""
        now = self.clock() if now is None else now
        self.scrape(now)
        return self.evaluate(now)

    def follow_inventory(self) -> None:
        """Scrape what the inventory holds now (between cycles, on the cycle's thread)."""
        inventory = self.inventory
        if inventory is None or inventory.version == self._inventory_version:
            return
        self._inventory_version = inventory.version
        self._retarget()

    def set_share(self, replicas: Sequence[str], me: str) -> None:
        """From now on scrape and evaluate only the engines `rendezvous_owner` gives
        `me` among the live `replicas` (between cycles, on the cycle's thread)."""
        share = (tuple(sorted({*replicas, me})), me)
        if share != self._share:
            self._share = share
            self._retarget()

    def owns(self, engine: str) -> bool:
        """Whether this replica evaluates `engine` (always, unless the fleet is split)."""
        if self._share is None:
            return True
        replicas, me = self._share
        return rendezvous_owner(engine, replicas) == me

    def _retarget(self) -> None:
        engines = self.inventory.engines() if self.inventory is not None else self.config.engines
        mine = {e.name for e in engines if self.owns(e.name)}
        self.scraper.set_targets([t for e in engines if e.name in mine for t in e.targets()])
        self.dispatcher.engines = {e.name: e for e in engines}
        # Handed to another replica (still in the inventory): dropped without a
        # resolve; an engine that left the inventory resolves as before.
        handed = {e.name for e in engines} - mine
        active = self.evaluator.active
        for key in [k for k in active if k[1][0] in handed]:
            del active[key]

    def scrape(self, now: float) -> None:
        self.follow_inventory()
        self.scraper.scrape_once(now)  # never raises for a target's fault

    def evaluate(self, now: float) -> list[IncidentEvent]:
        """Evaluate every rule on what was scraped; record and hand off the changes."""
        started = time.perf_counter()
        events = self.evaluator.evaluate(now)
        if self.metrics is not None:
            self.metrics.rule_evaluation.observe(time.perf_counter() - started)
            # One incident per (alert, engine), whatever the number of severities firing.
            incidents = {(rule.alert, engine) for rule, engine, _ in self.evaluator.firing()}
            firing = Counter(alert for alert, _engine in incidents)
            self.metrics.set_firing((r.alert for r in self.rules), firing)
        if isinstance(self.recorder, SqlIncidentSink):
            self.recorder.refresh(self.evaluator.open_alerts(), now)
        return events

    def close(self) -> None:
        self.scraper.close()

    def start(self, scheduler: BaseScheduler) -> Job:
        """Run the cycle every `rules.evaluation_interval` on `scheduler`."""
        return schedule_cycle(scheduler, self.run_cycle, self.config.evaluation_interval)


def rendezvous_owner(engine: str, replicas: Sequence[str]) -> str:
    """The replica that evaluates `engine`: the highest hash of (replica, engine).
    Every replica computes the same from the same live set; one that leaves moves
    only its own engines, each to the next highest (no migration, no table)."""
    return max(
        replicas,
        key=lambda r: hashlib.blake2b(f"{r}\n{engine}".encode(), digest_size=8).digest(),
    )

"""The rules leader: of several `runbook serve` replicas on one database, one
scrapes and evaluates the rules at a time.

Leadership is a lease row in the store (`rules-leader`). Every cycle the
leader takes or extends it before scraping and renews it again before
evaluating, so a replica that lost it meanwhile never hands an incident off.
A replica that stops (crash, lost database) is replaced within the lease's
TTL; a graceful stop gives the lease up at once. A replica that gains
leadership starts from empty windows (what it scraped as a follower would
be stale): its alerts go through `for` again, a new episode whose
remediation the executor's cooldown refuses if the previous leader already
acted.

With `split` (`rules.replicas: split`) every replica evaluates, each its
share of the engines: each holds a lease of its own (`rules-replica:...`,
renewed every cycle), and at every cycle the live leases name the replicas
among which rendezvous hashing gives each engine to exactly one
(RulesService.set_share). A replica that stops gracefully gives its lease up
and the others take its engines at their next cycle; one that crashes is
rebalanced when its lease lapses (`rules.leader_lease`), at the next cycle.

The cycle is a job of the service's scheduler (`schedule`): every
`rules.evaluation_interval`, never two at once, missed runs coalesced.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

from apscheduler.job import Job
from apscheduler.schedulers.base import BaseScheduler
from vllm_runbook.rules.scheduling import JOB_ID
from vllm_runbook.runbooks.service import heap
from vllm_runbook.runbooks.service.jobs import WakeableJob
from vllm_runbook.runbooks.store import Journal, StoreError

if TYPE_CHECKING:
    from vllm_runbook.runbooks.service.rules_service import RulesService
    from vllm_runbook.runbooks.service.telemetry import ServiceMetrics

log = logging.getLogger("vllm_runbook.service")

LEASE_NAME = "rules-leader"
REPLICA_LEASE_PREFIX = "rules-replica:"  # split: one lease per live replica
# How long a stop waits for a cycle in flight (scrapes have their own timeout).
STOP_TIMEOUT_S: Final = 60.0


class RulesLeader:
    def __init__(
        self,
        store: Journal,
        make_service: Callable[[], RulesService],
        ttl_seconds: float,
        *,
        metrics: ServiceMetrics | None = None,
        holder: str | None = None,
        clock: Callable[[], float] = time.time,
        split: bool = False,
        freeze_heap: bool = False,
    ) -> None:
        """`freeze_heap`: once the first cycle filled the windows, leave what is alive
        then out of garbage collection (`runbook serve`: service/heap.py)."""
        self.store = store
        self.make_service = make_service
        self.ttl_seconds = ttl_seconds
        self.metrics = metrics
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        self.clock = clock
        self.split = split
        self.freeze_heap = freeze_heap
        self.lease_name = (
            REPLICA_LEASE_PREFIX + hashlib.blake2b(self.holder.encode(), digest_size=12).hexdigest()
            if split
            else LEASE_NAME
        )
        self.replicas: tuple[str, ...] = ()  # split: the live replicas at the latest cycle
        self.service: RulesService | None = None
        self.cycles = 0  # cycles evaluated as the leader
        self._job = WakeableJob(self._pass, job_id=JOB_ID, name="rules")

    def schedule(self, scheduler: BaseScheduler, evaluation_interval: float) -> Job:
        """The cycle every `evaluation_interval` on `scheduler`, first now."""
        return self._job.schedule(scheduler, evaluation_interval)

    def _pass(self) -> bool:
        self.cycle()
        return False

    @property
    def is_leader(self) -> bool:
        return self.service is not None

    def _hold(self) -> bool:
        try:
            return self.store.acquire_lease(self.lease_name, self.holder, self.ttl_seconds)
        except StoreError as exc:
            # Leadership cannot be asserted without the database: stop evaluating
            # (another replica that can reach it takes over after the TTL).
            if self.is_leader:
                log.warning("rules leader: store unavailable, stepping down: %s", exc)
            return False

    def cycle(self) -> bool:
        """One scheduled cycle: scrape and evaluate if this replica leads; True if it did."""
        if not self._hold():
            self._step_down()
            return False
        if self.service is None:
            log.warning("rules leader: this replica (%s) evaluates the rules now", self.holder)
            self.service = self.make_service()
        if self.split and not self._share(self.service):
            self._step_down()
            return False
        now = self.clock()
        started = time.perf_counter()
        self.service.scrape(now)
        if not self._hold():  # lost during a slow scrape: someone else evaluates
            self._step_down()
            return False
        self.service.evaluate(now)
        self.cycles += 1
        if self.freeze_heap and self.cycles == 1:
            heap.freeze("the rules' first cycle")
        if self.metrics is not None:
            self.metrics.rules_cycle.observe(time.perf_counter() - started)
        return True

    def _share(self, service: RulesService) -> bool:
        """Give `service` this replica's share of the engines; False without the store."""
        try:
            live = self.store.live_holders(REPLICA_LEASE_PREFIX)
        except StoreError as exc:
            log.warning("rules replica: store unavailable, stepping down: %s", exc)
            return False
        replicas = tuple(sorted({*live, self.holder}))
        if replicas != self.replicas:
            log.warning(
                "rules replica %s: %d live replicas split the engines", self.holder, len(replicas)
            )
        self.replicas = replicas
        service.set_share(replicas, self.holder)
        return True

    def _step_down(self) -> None:
        if self.service is None:
            return
        log.warning("rules leader: %s no longer evaluates the rules", self.holder)
        self.service.close()
        self.service = None
        self.replicas = ()
        if self.metrics is not None:
            self.metrics.clear_firing()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """No further cycle (the one in flight ends first); give leadership up
        now, so another replica need not wait for the TTL."""
        if not self._job.stop(timeout_s):
            log.warning("rules leader: a cycle still runs after %g s; stepping down", timeout_s)
        was_leader = self.is_leader
        self._step_down()
        if was_leader:
            with contextlib.suppress(StoreError):
                self.store.release_lease(self.lease_name, self.holder)

"""`runbook serve` as one object: the app, the store and the background jobs, one lifecycle.

    service = build(config_path, db, host)      # serve_cli.build: nothing runs yet
    uvicorn.run(service.app, ...)                # the app's lifespan starts and stops the jobs

The service's periodic work is the jobs of this one APScheduler scheduler
(its pool has a thread per job), each never overlapping itself, missed runs
coalesced; those woken by new work are WakeableJobs (service/jobs.py):

- the webhook's writer (service/webhooks.py, GroupCommitter): commits the
  deliveries queued together in one transaction; woken by every delivery;
- the rules' cycle (service/leader.py), when the rules are evaluated here;
- the worker (service/worker.py), when this replica runs executions; woken
  by a webhook delivery or an answer taken here;
- the notifications' feed and one delivery per receiver (notify.py); the
  feed wakes a receiver's delivery when it queued rows for it;
- the retention of stored deliveries (service/retention.py);
- discovery's refresh of the inventory (service/discovery.py), when configured;
- the circuit breaker (runbooks/service/breaker.py, service/breaker_job.py), where
  this replica runs executions.

Beside the web server's threads (its event loop answers requests) the
service starts no thread of its own: the rules' scrapes run their event loop,
and keep their connections between cycles, in the rules' cycle's pass, on
this scheduler's pool (rules/scrape.py).

On shutdown (SIGTERM, SIGINT) the webhook's writer commits what it queued,
then `stop`: no job starts again; the rules' cycle in flight ends and
leadership is given up (another replica takes over at once); the worker's
execution in flight is waited for (up to worker.STOP_TIMEOUT_S; one still
running when the process ends is settled as interrupted by the next run on
this host); a notification in flight gives its claims back to the other
replicas at once; then the store's connections close (SQLite folds its
write-ahead log into the file).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from apscheduler.schedulers.background import BackgroundScheduler
from fastapi import FastAPI
from vllm_runbook.runbooks.model.config import Config
from vllm_runbook.runbooks.service.jobs import job_scheduler
from vllm_runbook.runbooks.service.leader import RulesLeader
from vllm_runbook.runbooks.service.retention import Retention
from vllm_runbook.runbooks.service.telemetry import ServiceMetrics
from vllm_runbook.runbooks.service.worker import Worker
from vllm_runbook.runbooks.store import Journal

if TYPE_CHECKING:
    from vllm_runbook.runbooks.model.catalogs import RunbookCatalog
    from vllm_runbook.runbooks.service.breaker_job import BreakerJob
    from vllm_runbook.runbooks.service.discovery import Discovery
    from vllm_runbook.runbooks.service.notify import Notifier
    from vllm_runbook.runbooks.service.webhooks import GroupCommitter

log = logging.getLogger("vllm_runbook.service")


@dataclass(eq=False)
class Service:
    """What `runbook serve` runs. `worker` is None with --no-worker, `leader`
    None when no rules are evaluated here, `notifier` None without receivers.
    `committer` is the webhook's writer (the app's). `app` is set by
    serve_cli.build once the app (whose lifespan is this service's) exists."""

    config: Config
    store: Journal
    runbooks: RunbookCatalog
    metrics: ServiceMetrics
    retention: Retention
    worker: Worker | None = None
    leader: RulesLeader | None = None
    notifier: Notifier | None = None
    discovery: Discovery | None = None
    breaker: BreakerJob | None = None
    committer: GroupCommitter | None = None
    app: FastAPI = field(init=False)
    scheduler: BackgroundScheduler = field(init=False)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)
    _started: bool = field(init=False, default=False)
    _stopped: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        # A pool thread per job: a slow job (an execution, a receiver's
        # retries) never holds another back. 1: the retention.
        jobs = 1 + (self.worker is not None) + (self.leader is not None)
        jobs += self.discovery is not None
        jobs += self.breaker is not None
        jobs += self.committer is not None
        jobs += self.notifier.job_count if self.notifier is not None else 0
        self.scheduler = job_scheduler(jobs)

    def start(self) -> None:
        """Schedule every job (each runs first now) and start the scheduler."""
        with self._lock:
            if self._started:
                return
            self._started = True
        if self.committer is not None:
            self.committer.schedule(self.scheduler)
        if self.discovery is not None:
            self.discovery.schedule(self.scheduler, self.config.discovery.refresh_interval_seconds)
        if self.leader is not None:
            self.leader.schedule(self.scheduler, self.config.evaluation_interval)
        if self.worker is not None:
            self.worker.schedule(self.scheduler)
        if self.notifier is not None:
            self.notifier.schedule(self.scheduler)
        self.retention.schedule(self.scheduler)
        if self.breaker is not None:
            self.breaker.schedule(self.scheduler)
        self.scheduler.start()

    def stop(self) -> None:
        """Stop the jobs (see the module doc) and close the store; once."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        if self.committer is not None:
            self.committer.close()  # done by the app's lifespan already, unless it failed
        if self.scheduler.running:
            self.scheduler.shutdown(wait=False)  # no new runs; each job's own stop waits
        if self.leader is not None:
            self.leader.stop()  # the other replicas need not wait for the lease to lapse
        if self.worker is not None:
            self.worker.stop()
        if self.notifier is not None:
            self.notifier.stop()
        self.retention.stop()
        if self.breaker is not None:
            self.breaker.stop()
        # Close the connections: SQLite folds its write-ahead log into the file.
        self.store.close()

    @asynccontextmanager
    async def lifespan(self, _app: FastAPI) -> AsyncIterator[None]:
        """The app's lifespan: the jobs run while it serves."""
        self.start()
        try:
            yield
        finally:
            await asyncio.to_thread(self.stop)

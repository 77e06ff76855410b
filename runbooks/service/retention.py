"""The retention job: stored Alertmanager deliveries pruned on the service's scheduler.

`runbook serve` adds it to its APScheduler scheduler (beside the rules'
cycle, the worker and the notifications): first at start, then every
`retention.interval`. Every replica may run it; the deletes are idempotent.
A store that fails is logged and tried again at the next run.
"""

from __future__ import annotations

import logging
from typing import Final

from apscheduler.job import Job
from apscheduler.schedulers.base import BaseScheduler
from vllm_runbook.runbooks.model.config import RetentionConfig
from vllm_runbook.runbooks.service import telemetry as T
from vllm_runbook.runbooks.service.jobs import WakeableJob
from vllm_runbook.runbooks.service.telemetry import ServiceMetrics
from vllm_runbook.runbooks.store import Journal, StoreError
from vllm_runbook.runbooks.store.webhook_events import Pruned

log = logging.getLogger("vllm_runbook.service")

JOB_ID: Final = "vllm-runbook-retention"
STOP_TIMEOUT_S: Final = 30.0


class Retention:
    def __init__(
        self, store: Journal, config: RetentionConfig, metrics: ServiceMetrics | None = None
    ) -> None:
        self.store = store
        self.config = config
        self.metrics = metrics
        self._job = WakeableJob(self._pass, job_id=JOB_ID, name="retention")

    def _pass(self) -> bool:
        self.run()
        return False

    def run(self) -> Pruned:
        """Prune once: deliveries older than max_age, then the oldest beyond max_size."""
        try:
            pruned = self.store.prune_webhook_events(
                max_age_s=self.config.max_age_seconds, max_bytes=self.config.max_bytes
            )
        except StoreError as exc:
            log.warning("retention: stored deliveries not pruned (tried again later): %s", exc)
            return Pruned()
        if self.metrics is not None:
            self.metrics.webhook_events_pruned.labels(T.PRUNED_MAX_AGE).inc(pruned.by_age)
            self.metrics.webhook_events_pruned.labels(T.PRUNED_MAX_SIZE).inc(pruned.by_size)
        if pruned.total:
            log.info(
                "retention: deleted %d stored deliveries (%d older than %g s, %d beyond %d bytes)",
                pruned.total,
                pruned.by_age,
                self.config.max_age_seconds,
                pruned.by_size,
                self.config.max_bytes,
            )
        return pruned

    def schedule(self, scheduler: BaseScheduler) -> Job:
        """Run now and then every interval; one at a time, missed runs coalesced."""
        return self._job.schedule(scheduler, self.config.interval_seconds)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """No further run; wait for the one in flight."""
        self._job.stop(timeout_s)

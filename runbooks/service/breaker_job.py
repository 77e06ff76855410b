"""The circuit breaker (runbooks/service/breaker.py) as a job of the service's scheduler.

Every `breaker.interval` (first at start), beside the worker and the
retention. A store or an engine that fails is logged and tried again at the
next pass.
"""

from __future__ import annotations

import logging
from typing import Final

from apscheduler.job import Job
from apscheduler.schedulers.base import BaseScheduler
from vllm_runbook.runbooks.service.breaker import Breaker
from vllm_runbook.runbooks.service.jobs import WakeableJob
from vllm_runbook.runbooks.store import StoreError

log = logging.getLogger("vllm_runbook.service")

JOB_ID: Final = "vllm-runbook-breaker"
STOP_TIMEOUT_S: Final = 30.0


class BreakerJob:
    def __init__(self, breaker: Breaker) -> None:
        self.breaker = breaker
        self._job = WakeableJob(self._pass, job_id=JOB_ID, name="breaker")

    def _pass(self) -> bool:
        try:
            self.breaker.tick()
        except StoreError as exc:
            log.warning("breaker: store unavailable (%s); retrying", exc)
        except Exception:
            log.exception("breaker: unexpected error; continuing")
        return False

    def schedule(self, scheduler: BaseScheduler) -> Job:
        return self._job.schedule(scheduler, self.breaker.config.interval_seconds)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        self._job.stop(timeout_s)

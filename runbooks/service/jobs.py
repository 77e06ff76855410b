"""Background work that can be woken: an interval job of the service's APScheduler scheduler.

    job = WakeableJob(work, job_id="vllm-runbook-worker", name="worker")
    job.schedule(scheduler, interval_s=1.0)   # first run now, then every interval
    job.wake()                                # new work: run now, not at the next interval
    job.stop(timeout_s=30)                    # no further run; wait for the one in flight

    scheduler = job_scheduler(job_count)      # the service's: a pool thread per job

`work()` does one pass and returns True when more is waiting (run again at
once). Like the rules' cycle and the retention, a job never overlaps itself
(max_instances=1) and missed runs are coalesced. A wake that arrives while a
pass runs is not lost: the pass runs again when it ends (a wake cannot
start a second instance, so it is remembered and run once the first ends).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from datetime import UTC, datetime

from apscheduler.events import EVENT_JOB_ERROR, EVENT_JOB_EXECUTED, JobExecutionEvent
from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.job import Job
from apscheduler.jobstores.base import JobLookupError
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.schedulers.base import BaseScheduler


class _ExpectedSkips(logging.Filter):
    """APScheduler warns at every interval a pass outlasts ("skipped: maximum
    number of running instances reached"): for these jobs that is how they work
    (one pass at a time, a wake remembered), and a worker running a 60-second
    execution would log it 60 times. Other jobs' warnings pass."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not (
            "maximum number of running instances reached" in text
            and any(f'job "{name} (' in text for name in self.names)
        )


_SKIPS = _ExpectedSkips()
logging.getLogger("apscheduler.scheduler").addFilter(_SKIPS)


def job_scheduler(job_count: int) -> BackgroundScheduler:
    """A scheduler (not started) whose pool has a thread per job: a slow job (an
    execution, a receiver's retries) never holds another back."""
    return BackgroundScheduler(executors={"default": ThreadPoolExecutor(max_workers=job_count)})


class WakeableJob:
    def __init__(self, work: Callable[[], bool], *, job_id: str, name: str) -> None:
        self.work = work
        self.job_id = job_id
        self.name = name
        self._lock = threading.Lock()
        self._woken = False
        self._running = False
        self._stopped = False
        self._idle = threading.Event()
        self._idle.set()
        self._job: Job | None = None
        _SKIPS.names.add(name)

    def schedule(self, scheduler: BaseScheduler, interval_s: float) -> Job:
        """Run now, then every `interval_s`; one at a time, missed runs coalesced."""
        self._job = scheduler.add_job(
            self._run,
            "interval",
            seconds=interval_s,
            id=self.job_id,
            name=self.name,
            max_instances=1,
            coalesce=True,
            misfire_grace_time=None,  # late (a busy pool) is still worth running
            next_run_time=datetime.now(UTC),
        )
        scheduler.add_listener(self._finished, EVENT_JOB_EXECUTED | EVENT_JOB_ERROR)
        return self._job

    def wake(self) -> None:
        """New work was recorded: run now rather than at the next interval."""
        with self._lock:
            self._woken = True
            if self._running or self._stopped:
                return  # the pass in flight runs again when it ends
        self._run_now()

    def stop(self, timeout_s: float) -> bool:
        """No further run; wait up to `timeout_s` for the pass in flight. True if none is left."""
        with self._lock:
            self._stopped = True
        if self._job is not None:
            with contextlib.suppress(JobLookupError):  # the scheduler was shut down first
                self._job.remove()
        return self._idle.wait(timeout_s)

    @property
    def running(self) -> bool:
        return not self._idle.is_set()

    @property
    def scheduled(self) -> bool:
        """On a scheduler and not stopped: `wake` runs it there."""
        return self._job is not None and not self._stopped

    def _run_now(self) -> None:
        job = self._job
        if job is None:
            return  # not scheduled (a test drives the work by hand)
        with contextlib.suppress(JobLookupError):  # removed: stopping
            job.modify(next_run_time=datetime.now(UTC))

    def _run(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._running = True
            self._idle.clear()
        try:
            while True:
                with self._lock:
                    self._woken = False
                more = self.work()
                with self._lock:
                    if self._stopped or not (more or self._woken):
                        break
        finally:
            with self._lock:
                self._running = False
            self._idle.set()

    def _finished(self, event: JobExecutionEvent) -> None:
        # Called once the scheduler counts the instance as ended: a wake that
        # came between the pass's last look and then was refused as a second
        # instance; run it now.
        if event.job_id != self.job_id:
            return
        with self._lock:
            pending = self._woken and not (self._running or self._stopped)
        if pending:
            self._run_now()

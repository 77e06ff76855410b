from collections.abc import Callable, Iterator

import pytest
from apscheduler.schedulers.background import BackgroundScheduler
from vllm_runbook.runbooks.service.jobs import job_scheduler
from vllm_runbook.runbooks.service.notify import Notifier
from vllm_runbook.runbooks.service.worker import Worker

from tests.journal.conftest import (  # noqa: F401 - fixtures shared with the journal tests
    db_url,
    fresh_pg_database,
    pg_database,
    pg_migrated,
    pg_url,
    sqlite_template,
    sqlite_url,
)

Schedule = Callable[..., BackgroundScheduler]


@pytest.fixture
def scheduled() -> Iterator[Schedule]:
    """`scheduled(worker, notifier, ...)`: their jobs on one scheduler the test
    owns, started, sized as `runbook serve` sizes its own (a pool thread per
    job, service/lifecycle.py). At the end each is stopped (again, if the test
    did) and the scheduler shut down."""
    owned: list[tuple[BackgroundScheduler, tuple[Worker | Notifier, ...]]] = []

    def schedule(*owners: Worker | Notifier) -> BackgroundScheduler:
        jobs = sum(o.job_count if isinstance(o, Notifier) else 1 for o in owners)
        scheduler = job_scheduler(jobs)
        for owner in owners:
            owner.schedule(scheduler)
        scheduler.start()
        owned.append((scheduler, owners))
        return scheduler

    yield schedule
    for scheduler, owners in owned:
        for owner in owners:
            owner.stop()
        scheduler.shutdown(wait=False)

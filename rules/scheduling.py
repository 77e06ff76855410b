"""Wiring: scrape then evaluate every `evaluation_interval`, on an APScheduler 3 scheduler."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from apscheduler.job import Job
from apscheduler.schedulers.base import BaseScheduler
from vllm_runbook.rules.evaluator import Evaluator
from vllm_runbook.rules.scrape import Scraper

JOB_ID = "vllm-runbook-rules"


def run_cycle(scraper: Scraper, evaluator: Evaluator) -> None:
    now = time.time()
    scraper.scrape_once(now)  # never raises for a target's fault
    evaluator.evaluate(now)


def schedule(
    scheduler: BaseScheduler, scraper: Scraper, evaluator: Evaluator, evaluation_interval: float
) -> Job:
    """Add the cycle as one interval job: never two at once, missed runs coalesced."""
    return schedule_cycle(scheduler, run_cycle, evaluation_interval, args=(scraper, evaluator))


def schedule_cycle(
    scheduler: BaseScheduler,
    cycle: Callable[..., Any],
    evaluation_interval: float,
    args: tuple[Any, ...] = (),
) -> Job:
    """`cycle(*args)` every interval, first run now, one at a time, missed runs coalesced."""
    return scheduler.add_job(
        cycle,
        "interval",
        args=args,
        seconds=evaluation_interval,
        id=JOB_ID,
        max_instances=1,
        coalesce=True,
        next_run_time=datetime.now(),
    )

"""Wiring: scrape then evaluate every `evaluation_interval`, on an APScheduler 3 scheduler."""

from __future__ import annotations

import time
from datetime import datetime

from apscheduler.job import Job
from apscheduler.schedulers.base import BaseScheduler

from rules.evaluator import Evaluator
from rules.scrape import Scraper


def run_cycle(scraper: Scraper, evaluator: Evaluator) -> None:
    now = time.time()
    scraper.scrape_once(now)  # never raises for a target's fault
    evaluator.evaluate(now)


def schedule(
    scheduler: BaseScheduler, scraper: Scraper, evaluator: Evaluator, evaluation_interval: float
) -> Job:
    """Add the cycle as one interval job: never two at once, missed runs coalesced."""
    return scheduler.add_job(
        run_cycle,
        "interval",
        args=(scraper, evaluator),
        seconds=evaluation_interval,
        id="vllm-runbook-rules",
        max_instances=1,
        coalesce=True,
        next_run_time=datetime.now(),
    )

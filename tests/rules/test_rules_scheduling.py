"""The APScheduler wiring: one interval job, never overlapping, surviving dead targets."""

from __future__ import annotations

import socket
from datetime import timedelta

from apscheduler.schedulers.background import BackgroundScheduler
from vllm_runbook.rules.evaluator import Evaluator, store_for_rules
from vllm_runbook.rules.incidents import MemoryIncidentSink
from vllm_runbook.rules.model import load_catalog
from vllm_runbook.rules.scheduling import run_cycle, schedule
from vllm_runbook.rules.scrape import Scraper, Target


def test_schedule_adds_one_coalescing_interval_job() -> None:
    rules = load_catalog().bind()
    store = store_for_rules(rules)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    scraper = Scraper(store, [Target(f"http://127.0.0.1:{port}/metrics", "gone")], timeout=1.0)
    evaluator = Evaluator(rules, store, MemoryIncidentSink())
    scheduler = BackgroundScheduler()
    job = schedule(scheduler, scraper, evaluator, 5.0)
    assert (job.trigger.interval, job.max_instances, job.coalesce) == (
        timedelta(seconds=5),
        1,
        True,
    )
    run_cycle(scraper, evaluator)  # a dead target is counted, not raised
    assert scraper.error_counts == {(f"http://127.0.0.1:{port}/metrics", "unreachable"): 1}

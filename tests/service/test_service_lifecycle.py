"""`runbook serve` as one object: its jobs on one scheduler, started and stopped
by the app's lifespan; a job woken while it runs runs again; the store's
errors answered by one handler."""

from __future__ import annotations

import html
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from apscheduler.schedulers.background import BackgroundScheduler
from fastapi.testclient import TestClient
from vllm_runbook.runbooks.service import breaker_job, retention, webhooks, worker
from vllm_runbook.runbooks.service.jobs import WakeableJob
from vllm_runbook.runbooks.service.notify import FEED_JOB_ID
from vllm_runbook.runbooks.service.serve_cli import build
from vllm_runbook.runbooks.store import StoreUnavailable

from tests.service.test_service_webhooks import payload

TOKEN = "lifecycle-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Work:
    """A pass that blocks until released, counting passes and overlaps."""

    def __init__(self) -> None:
        self.passes = 0
        self.inside = 0
        self.most_inside = 0
        self.entered = threading.Event()
        self.release = threading.Event()
        self.lock = threading.Lock()

    def __call__(self) -> bool:
        with self.lock:
            self.passes += 1
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
        self.entered.set()
        self.release.wait(10)
        with self.lock:
            self.inside -= 1
        return False


def wait_until(condition: object, limit: float = 5.0) -> bool:
    deadline = time.monotonic() + limit
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_wake_during_a_pass_runs_it_again_once_and_never_alongside() -> None:
    work = Work()
    job = WakeableJob(work, job_id="test-job", name="test")
    scheduler = BackgroundScheduler()
    job.schedule(scheduler, interval_s=3600.0)  # only the first run and the wakes
    scheduler.start()
    try:
        assert work.entered.wait(5)  # the first pass, at start
        work.entered.clear()
        job.wake()
        job.wake()  # two wakes during one pass: one more pass
        time.sleep(0.2)
        assert work.passes == 1  # not alongside the one in flight
        work.release.set()
        assert wait_until(lambda: work.passes == 2)
        assert wait_until(lambda: not job.running)
        time.sleep(0.2)
        assert (work.passes, work.most_inside) == (2, 1)
        # Idle, a wake runs it at once (the interval is an hour).
        job.wake()
        assert wait_until(lambda: work.passes == 3)
    finally:
        assert job.stop(5)
        scheduler.shutdown(wait=False)


def test_stop_waits_for_the_pass_in_flight_and_none_runs_after() -> None:
    work = Work()
    job = WakeableJob(work, job_id="test-job", name="test")
    scheduler = BackgroundScheduler()
    job.schedule(scheduler, interval_s=0.05)
    scheduler.start()
    assert work.entered.wait(5)
    scheduler.shutdown(wait=False)
    assert job.stop(0.2) is False  # still in flight
    job.wake()  # ignored: stopping
    work.release.set()
    assert job.stop(5) is True
    time.sleep(0.2)
    assert work.passes == 1


def config(tmp_path: Path) -> Path:
    (tmp_path / "token").write_text(TOKEN + "\n")
    path = tmp_path / "runbook.yaml"
    path.write_text(
        "engines:\n"
        "  - {name: engine-a, agent: 'http://127.0.0.1:9'}\n"
        f"database: sqlite:///{tmp_path / 'j.db'}\n"
        "webhook: {token_file: token}\n"
        "notifications:\n"
        "  receivers:\n"
        "    - {name: ops, type: webhook, url: 'http://127.0.0.1:9/hook'}\n"
    )
    return path


def test_the_lifespan_runs_the_jobs_of_one_scheduler_and_stops_them(tmp_path: Path) -> None:
    service = build(str(config(tmp_path)), None, "127.0.0.1", worker=True, rules=False)
    assert service.worker is not None and service.notifier is not None
    assert service.leader is None and not service.scheduler.running  # nothing runs yet
    committer = service.committer
    assert committer is not None and not committer.scheduled
    writers: list[threading.Thread] = []
    record = service.store.record_deliveries

    def recorded(*args: Any, **kwargs: Any) -> Any:
        writers.append(threading.current_thread())
        return record(*args, **kwargs)

    service.store.record_deliveries = recorded  # type: ignore[method-assign]
    with TestClient(service.app, base_url="http://127.0.0.1") as client:
        assert client.get("/healthz").json() == {"status": "ok"}
        jobs = {job.id for job in service.scheduler.get_jobs()}
        assert jobs == {
            webhooks.JOB_ID,
            worker.JOB_ID,
            retention.JOB_ID,
            breaker_job.JOB_ID,
            FEED_JOB_ID,
            "vllm-runbook-notify-ops",
        }
        pool = service.scheduler._executors["default"]._pool  # type: ignore[attr-defined]
        assert pool._max_workers == len(jobs)  # a thread per job: none waits for another's
        # A delivery is committed by the writer's job, on the scheduler's pool.
        answer = client.post("/webhooks/alertmanager", json=payload(), headers=AUTH)
        assert answer.status_code == 200, answer.text
        assert committer.scheduled
        assert writers and set(writers) <= set(pool._threads)
    assert not service.scheduler.running and not committer.scheduled
    service.stop()  # once: the lifespan stopped it


def test_the_store_s_errors_are_answered_by_one_handler(tmp_path: Path) -> None:
    service = build(str(config(tmp_path)), None, "127.0.0.1", worker=False, rules=False)
    client = TestClient(service.app, base_url="http://127.0.0.1")

    def down(*_args: object, **_kwargs: object) -> None:
        raise StoreUnavailable("store sqlite:///j.db unavailable: disk I/O error")

    store = service.store
    try:
        for method in ("probe_write", "list_executions", "pending_page", "list_incidents"):
            setattr(store, method, down)
        expected = {"error": "store unavailable: store sqlite:///j.db unavailable: disk I/O error"}
        for path in ("/healthz", "/api/executions", "/api/pending", "/api/incidents"):
            answer = client.get(path)
            assert (answer.status_code, answer.json()) == (503, expected), path
        page = client.get("/")
        assert page.status_code == 503
        assert page.headers["content-type"].startswith("text/html")
        assert page.text == expected["error"]
        missing = client.post("/api/executions/999/approve", headers=AUTH)
        assert (missing.status_code, missing.json()) == (404, {"error": "no execution with id 999"})
    finally:
        store.close()


def test_a_pass_outlasting_its_interval_is_not_logged_every_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """APScheduler's "skipped: maximum number of running instances reached" is
    how a wakeable job works (one pass at a time): not a warning per interval.
    Another job's skip still is."""
    release = threading.Event()
    job = WakeableJob(lambda: bool(release.wait(5)) and False, job_id="slow", name="slow")
    scheduler = BackgroundScheduler()
    scheduler.add_job(lambda: release.wait(5), "interval", seconds=0.1, id="other", name="other")
    job.schedule(scheduler, interval_s=0.1)
    with caplog.at_level(logging.WARNING, logger="apscheduler"):
        scheduler.start()
        time.sleep(1.0)
        release.set()
        job.stop(timeout_s=5)
        scheduler.shutdown(wait=True)
    skips = [r.getMessage() for r in caplog.records if "maximum number" in r.getMessage()]
    assert skips and all('job "other (' in m for m in skips)


def test_a_breaker_trip_is_on_the_metrics_and_on_the_page(tmp_path: Path) -> None:
    from vllm_runbook.runbooks.service.breaker import BREAKER_RUNBOOK, BREAKER_WHO

    service = build(str(config(tmp_path)), None, "127.0.0.1", worker=True, rules=False)
    assert service.breaker is not None
    metric = 'vllm_runbook_service_breaker_trips_total{engine="engine-a",reason="%s"} %s'
    client = TestClient(service.app, base_url="http://127.0.0.1")
    text = client.get("/metrics", headers=AUTH).text
    for reason in ("preemption_rate", "error_rate", "p99_over_sla"):
        assert metric % (reason, "0.0") in text  # from 0: the first trip counts
    page = client.get("/").text
    assert "Circuit breaker trips (0)" in page
    # A trip as the breaker journals one (runbooks/service/breaker.py) and counts it.
    store = service.store
    record, _ = store.create_execution(
        BREAKER_RUNBOOK, "http://127.0.0.1:9", trigger="rule", who=BREAKER_WHO, reason="why"
    )
    why = "circuit breaker: 3 preemptions per 50 finished requests = 6.00% > 1.00%"
    store.record_verification(
        record.id,
        {"signal": "preemption_rate", "before": 0.01, "after": 0.06, "breaker": {"why": why}},
    )
    service.metrics.breaker_tripped("http://127.0.0.1:9", "preemption_rate")
    assert metric % ("preemption_rate", "1.0") in client.get("/metrics", headers=AUTH).text
    page = client.get("/").text
    assert "Circuit breaker trips (1)" in page
    assert f'<tr id="trip-{record.id}">' in page and html.escape(why) in page
    service.stop()

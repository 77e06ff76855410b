"""Two `runbook serve` replicas on one PostgreSQL: one evaluates the rules at a time.

Each replica's /metrics says whether it evaluates (its rule evaluation
histogram counts cycles; the scrape errors of the inventory's engine, which
does not exist, are counted only where it scrapes) and /healthz says whether
it leads. The leader stopping gracefully hands over at the follower's next
cycle; the leader killed hands over once its lease lapses (the TTL).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from vllm_runbook.runbooks.demo.servers import free_port, start_logged, stop_group, wait_http
from vllm_runbook.runbooks.store import Journal, upgrade

from tests.engines import runbook_cli_command, runbook_cli_env

pytestmark = pytest.mark.service

INTERVAL, TTL = 0.5, 6.0
CONFIG = f"""\
engines:
  - name: engine-a
    agent: http://127.0.0.1:{{dead}}
rules:
  evaluation_interval: {int(INTERVAL * 1000)}ms
  leader_lease: {TTL:g}s
"""
EVALUATIONS = "vllm_runbook_service_rule_evaluation_seconds_count"
SCRAPE_ERRORS = "vllm_runbook_service_scrape_errors_total"


class Replica:
    def __init__(self, db_url: str, config: Path, tmp_path: Path, name: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / f"{name}.log"
        cmd = runbook_cli_command("serve", "--config", str(config), "--db", db_url,
                                  "--port", str(self.port), "--no-worker")  # fmt: skip
        self.proc = start_logged(cmd, self.log, runbook_cli_env({"RUNBOOK_WEBHOOK_TOKEN": "t"}))
        try:
            wait_http(self.url + "/healthz", 60, self.proc)
        except (RuntimeError, TimeoutError):
            self.stop()
            raise RuntimeError(f"replica {name} did not start:\n{self.log.read_text()}") from None

    def leads(self) -> bool:
        return bool(httpx.get(self.url + "/healthz", timeout=5).json()["rules_leader"])

    def sample(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=5).text
        return sum(
            s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == name
        )

    def stop(self, sig: int = signal.SIGTERM) -> None:
        stop_group(self.proc, 20, sig)


def wait_for(condition: Callable[[], bool], limit: float) -> float:
    """Seconds until `condition` held (polled every 0.1 s); fails after `limit`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > limit:
            raise AssertionError(f"not within {limit:g} s")
        time.sleep(0.1)
    return time.monotonic() - start


@pytest.fixture
def replicas(fresh_pg_database: str, tmp_path: Path) -> Iterator[Callable[[str], Replica]]:
    upgrade(fresh_pg_database)
    config = tmp_path / "runbook.yaml"
    config.write_text(CONFIG.format(dead=free_port()))
    started: list[Replica] = []

    def start(name: str) -> Replica:
        started.append(Replica(fresh_pg_database, config, tmp_path, name))
        return started[-1]

    try:
        yield start
    finally:
        for replica in started:
            replica.stop(signal.SIGKILL)


def only_one_evaluates(leader: Replica, follower: Replica) -> None:
    """Over a few cycles the leader's count grows and the follower's stays 0."""
    before = leader.sample(EVALUATIONS)
    time.sleep(4 * INTERVAL)
    assert (leader.leads(), follower.leads()) == (True, False)
    assert leader.sample(EVALUATIONS) >= before + 2
    assert follower.sample(EVALUATIONS) == 0
    assert leader.sample(SCRAPE_ERRORS) > 0 and follower.sample(SCRAPE_ERRORS) == 0


def test_one_replica_evaluates_and_the_other_takes_over(
    replicas: Callable[[str], Replica], fresh_pg_database: str, capsys: pytest.CaptureFixture[str]
) -> None:
    a = replicas("a")
    wait_for(a.leads, 10)
    b = replicas("b")
    only_one_evaluates(a, b)
    # Each replica's long-lived objects leave garbage collection once built, and the
    # leader's again after its first cycle (service/heap.py); the follower's not.
    frozen = "long-lived objects left out of garbage collection"
    assert all("built: " in r.log.read_text() and frozen in r.log.read_text() for r in (a, b))
    firsts = [r.log.read_text().count("the rules' first cycle: ") for r in (a, b)]
    assert firsts == [1, 0]

    a.stop(signal.SIGTERM)  # graceful: the lease is released
    handover = wait_for(b.leads, TTL)
    # Released, not lapsed: a lapse comes at least TTL - INTERVAL after the last renewal.
    assert handover < TTL - INTERVAL - 0.5
    assert b.sample(EVALUATIONS) > 0

    a = replicas("a2")  # back, as a follower
    only_one_evaluates(b, a)

    killed = time.monotonic()
    b.stop(signal.SIGKILL)  # a crash: the lease must lapse first
    takeover = wait_for(a.leads, TTL + 2 * INTERVAL + 2)
    evaluating = wait_for(lambda: a.sample(EVALUATIONS) > 0, 5) + takeover
    with capsys.disabled():
        print(
            f"\nrules leader: graceful stop -> follower leads in {handover:.2f} s; "
            f"leader killed -> follower leads in {time.monotonic() - killed:.2f} s "
            f"(lease TTL {TTL:g} s, interval {INTERVAL:g} s), evaluates after {evaluating:.2f} s"
        )
    # Not before the killed leader's lease lapsed: at least TTL after its last renewal.
    assert takeover >= TTL - INTERVAL - 0.5
    store = Journal(fresh_pg_database)
    try:
        assert store.lease_holder("rules-leader") is not None
    finally:
        store.close()

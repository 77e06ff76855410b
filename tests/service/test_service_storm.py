"""A storm on two replicas: 2,000 alerts in 20 deliveries of 100, two `runbook
serve` processes (real uvicorn) on one PostgreSQL, one of them killed with
SIGKILL half-way while it holds notification claims.

Oracles, all exact: every delivery answered 200 is in the journal (20 events,
2,000 executions); every event of every execution is in the events table as
the final journal implies it, and reached both receivers (a JSON webhook and
a Slack-compatible one) with its key; a key arrived twice only for a claim
the killed replica held when it died, and every such claim was sent again by
the survivor; the approvals answered on the oldest and the newest execution
each ran exactly once (each engine's agent saw one run's writes).

The engines are in-memory agents behind HTTP (tests/fake_agent.py: AgentHTTP); the
runbook is in `approve` mode, so 1,998 executions wait for a person and only
the two approved ones act."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, text
from vllm_runbook.runbooks.demo.servers import free_port, start_logged, stop_group, wait_http
from vllm_runbook.runbooks.service.notify import events_of
from vllm_runbook.runbooks.store import Journal, upgrade
from vllm_runbook.runbooks.store.models import ExecutionStatus

from tests.engines import runbook_cli_command, runbook_cli_env
from tests.fake_agent import STARTUP, AgentHTTP, FakeAgent

pytestmark = pytest.mark.service

TOKEN = "storm-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ENGINES = 4
DELIVERIES, PER_DELIVERY = 20, 100
KILL_AFTER = 10  # deliveries answered before the second replica dies
# What oom-pressure does to an in-memory agent, once.
ONE_RUN = [{"max_num_batched_tokens": 256}, {"max_num_seqs": 12}, {"autopilot": True}]


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        # The killed replica's connection breaks mid-answer: expected, not news.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class Receivers:
    """The notification receivers: /hook (JSON webhook) and /slack (text),
    every body kept in arrival order. A few milliseconds per request, so a
    replica's claims are held for a while (as with a real receiver)."""

    def __init__(self) -> None:
        self.bodies: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.lock = threading.Lock()
        receivers = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                time.sleep(0.003)
                with receivers.lock:
                    receivers.bodies[self.path].append(body)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = _Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def count(self) -> int:
        with self.lock:
            return sum(len(b) for b in self.bodies.values())

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


SLACK_FIRST = re.compile(r"^\[(?P<event>[A-Z ]+)\] oom-pressure on \S+ \(execution #(?P<id>\d+)\)$")


def received(receivers: Receivers) -> dict[str, list[tuple[int, str, str]]]:
    """(execution id, event, key) of every message, per receiver."""
    out: dict[str, list[tuple[int, str, str]]] = {"ops": [], "chat": []}
    for body in receivers.bodies["/hook"]:
        assert body["text"].splitlines()[-1] == f"Event key: {body['key']}"
        out["ops"].append((body["execution_id"], body["event"], body["key"]))
    for body in receivers.bodies["/slack"]:
        lines = body["text"].splitlines()
        first = SLACK_FIRST.match(lines[0])
        assert first is not None, lines[0]
        assert lines[-1].startswith("Event key: "), lines
        key = lines[-1].removeprefix("Event key: ")
        out["chat"].append((int(first["id"]), first["event"].lower(), key))
    return out


def config(path: Path, agents: list[AgentHTTP], receivers: Receivers) -> Path:
    engines = "".join(
        f"  - name: engine-{i}\n"
        f"    agent: {agent.url}\n"
        f'    labels: {{instance: "10.0.0.{i}:8000"}}\n'
        for i, agent in enumerate(agents)
    )
    path.write_text(
        f"""\
engines:
{engines}automation:
  oom-pressure: approve
approvals:
  timeout: 30m
notifications:
  receivers:
    - {{name: ops, type: webhook, url: "{receivers.url}/hook"}}
    - {{name: chat, type: slack, url: "{receivers.url}/slack"}}
  retries: 2
  backoff: 200ms
  timeout: 1s
  claim_lease: 4s
executor:
  verify_seconds: 1s
  condition_seconds: 200ms
  healthy_period_seconds: 100ms
"""
    )
    return path


def delivery(number: int, starts_at: datetime) -> dict[str, Any]:
    """Delivery `number`: alerts number*100 .. number*100+99, spread over the engines."""
    alerts = []
    for i in range(number * PER_DELIVERY, (number + 1) * PER_DELIVERY):
        labels = {
            "alertname": "VllmOOMPressure",
            "instance": f"10.0.0.{i % ENGINES}:8000",
            "severity": "critical",
            "runbook": "oom-pressure",
            "storm": str(i),
        }
        alerts.append(
            {
                "status": "firing",
                "labels": labels,
                "annotations": {"summary": "KV cache full"},
                "startsAt": starts_at.isoformat().replace("+00:00", "Z"),
                "endsAt": "0001-01-01T00:00:00Z",
                "generatorURL": "http://127.0.0.1:9090/graph",
                "fingerprint": f"storm-{i:05d}",
            }
        )
    return {
        "version": "4",
        "groupKey": f'{{}}:{{storm="{number}"}}',
        "truncatedAlerts": 0,
        "status": "firing",
        "receiver": "vllm-runbook",
        "groupLabels": {"alertname": "VllmOOMPressure"},
        "commonLabels": {"alertname": "VllmOOMPressure"},
        "commonAnnotations": {},
        "externalURL": "http://127.0.0.1:9093",
        "alerts": alerts,
    }


class Serve:
    """`runbook serve` of this checkout (real uvicorn), its worker and notifier on."""

    def __init__(self, name: str, cfg: Path, db_url: str, tmp_path: Path) -> None:
        self.name = name
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = tmp_path / f"{name}.log"
        cmd = runbook_cli_command("serve", "--config", str(cfg), "--db", db_url,
                                  "--port", str(port), "--no-rules")  # fmt: skip
        env = runbook_cli_env({"RUNBOOK_WEBHOOK_TOKEN": TOKEN})
        env.pop("VLLM_RUNBOOK_TOKEN", None)
        self.proc = start_logged(cmd, self.log, env)
        try:
            wait_http(self.url + "/healthz", 90, self.proc, self.log)
        except BaseException:
            self.stop()
            raise

    def post(self, path: str, body: Any = None) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers=AUTH, timeout=60)

    def stop(self) -> None:
        stop_group(self.proc, 30)


def wait_for(condition: Callable[[], bool], limit: float, what: str) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, f"not within {limit:g} s: {what}"
        time.sleep(0.05)


@pytest.fixture
def agents() -> Iterator[list[AgentHTTP]]:
    servers = [AgentHTTP(FakeAgent.kv_bound()) for _ in range(ENGINES)]
    yield servers
    for server in servers:
        server.close()


@pytest.fixture
def receivers() -> Iterator[Receivers]:
    r = Receivers()
    yield r
    r.close()


def test_a_storm_over_two_replicas_one_killed_loses_nothing(
    fresh_pg_database: str,
    agents: list[AgentHTTP],
    receivers: Receivers,
    tmp_path: Path,
) -> None:
    began = time.monotonic()
    db_url = fresh_pg_database
    upgrade(db_url)
    cfg = config(tmp_path / "runbook.yaml", agents, receivers)
    store = Journal(db_url)
    sql = create_engine(db_url.replace("postgresql://", "postgresql+psycopg://"))

    def scalar(query: str, **params: Any) -> Any:
        with sql.connect() as conn:
            return conn.execute(text(query), params).scalar()

    def execution_status(execution_id: int) -> str:
        return str(scalar("SELECT status FROM executions WHERE id = :i", i=execution_id))

    a = Serve("a", cfg, db_url, tmp_path)
    b = Serve("b", cfg, db_url, tmp_path)
    phases = {"started": time.monotonic() - began}
    held: set[int] = set()
    try:
        starts_at = datetime.now(UTC) - timedelta(minutes=1)
        answered = 0
        oldest = newest = None
        for number in range(DELIVERIES):
            replica = b if number % 2 and number < KILL_AFTER else a
            response = replica.post("/webhooks/alertmanager", delivery(number, starts_at))
            assert response.status_code == 200, response.text
            created = response.json()["executions"]
            assert len(created) == PER_DELIVERY and all(e["created"] for e in created)
            answered += 1
            if number == 0:
                # The oldest execution: approved at once, run by whichever replica.
                oldest = min(e["id"] for e in created)
                assert a.post(f"/api/executions/{oldest}/approve", {"note": "oldest"}).is_success
                wait_for(
                    lambda i=oldest: execution_status(i) == ExecutionStatus.SUCCEEDED,
                    60,
                    "oldest ran",
                )
            if number == KILL_AFTER - 1:
                held = kill_holding_claims(b, scalar)
            newest = max([e["id"] for e in created] + [newest or 0])
        assert oldest is not None and newest is not None
        phases["delivered"] = time.monotonic() - began
        # The newest execution, behind 1,998 others awaiting a person.
        assert a.post(f"/api/executions/{newest}/approve", {"note": "newest"}).is_success
        wait_for(lambda: execution_status(newest) == ExecutionStatus.SUCCEEDED, 60, "newest ran")

        phases["newest ran"] = time.monotonic() - began
        events = int(scalar("SELECT count(*) FROM execution_events"))
        assert events == DELIVERIES * PER_DELIVERY + 2 * 2  # awaiting each; started, succeeded
        wait_for(
            lambda: (
                scalar("SELECT count(*) FROM notifications WHERE status = 'delivered'")
                == 2 * events
            ),
            120,
            "every notification delivered",
        )
        phases["notified"] = time.monotonic() - began
        time.sleep(1.0)  # a stray duplicate would arrive now
        storm_s = time.monotonic() - began
    finally:
        for replica in (a, b):
            replica.stop()

    # Every answered delivery is in the journal; one execution per alert.
    assert scalar("SELECT count(*) FROM webhook_events") == answered == DELIVERIES
    assert scalar("SELECT count(*) FROM executions") == DELIVERIES * PER_DELIVERY
    assert scalar("SELECT count(*) FROM notifications WHERE status <> 'delivered'") == 0

    # Every event the final journal implies is recorded, once, with a key.
    with sql.connect() as conn:
        ids = list(conn.execute(text("SELECT id FROM executions ORDER BY id")).scalars())
        journal = {
            (execution_id, event): key
            for execution_id, event, key in conn.execute(
                text("SELECT execution_id, event, key FROM execution_events")
            )
        }
        retaken = set(
            conn.execute(text("SELECT receiver, event_key FROM notifications WHERE claims > 1"))
        )
        held_keys = set(
            conn.execute(
                text("SELECT receiver, event_key FROM notifications WHERE id = ANY(:ids)"),
                {"ids": sorted(held)},
            )
        )
    assert len(journal) == events
    expected = {(i, "awaiting approval") for i in ids} | {
        (i, e) for i in (oldest, newest) for e in ("started", "succeeded")
    }
    assert set(journal) == expected
    for execution_id in (oldest, newest, ids[1]):
        implied = events_of(store.get_execution(execution_id))
        assert {e for (i, e) in journal if i == execution_id} == set(implied)

    # Every event reached both receivers, carrying its key; a key came twice
    # only for a claim the killed replica held, and each of those was re-sent.
    key_of = {key: pair for pair, key in journal.items()}
    assert held_keys and retaken == held_keys
    duplicates = 0
    for receiver, messages in received(receivers).items():
        for execution_id, event, key in messages:
            assert key_of[key] == (execution_id, event)
        counts = Counter(key for _, _, key in messages)
        assert set(counts) == set(key_of), f"{receiver}: events lost"
        twice = {key for key, n in counts.items() if n > 1}
        assert set(counts.values()) <= {1, 2}
        assert {(receiver, key) for key in twice} <= held_keys
        duplicates += len(twice)

    # The approved executions ran exactly once each: one run's writes on its engine.
    assert [agents[i].agent.writes for i in range(ENGINES)] == [ONE_RUN, [], [], ONE_RUN]
    assert agents[1].agent.knobs == agents[2].agent.knobs == STARTUP
    for execution_id, note in ((oldest, "oldest"), (newest, "newest")):
        done = store.get_execution(execution_id)
        assert (done.status, done.decided_by, done.decision_note) == (
            ExecutionStatus.SUCCEEDED,
            "webhook token",
            note,
        )
    store.close()
    sql.dispose()
    print(
        f"\nstorm: {DELIVERIES * PER_DELIVERY} alerts, {events} events, {2 * events} "
        f"notifications, {len(held)} claims held by the killed replica, {duplicates} "
        f"duplicate(s) received; {storm_s:.1f} s ("
        + ", ".join(f"{k} +{v:.1f} s" for k, v in phases.items())
        + ")"
    )


def kill_holding_claims(replica: Serve, scalar: Callable[..., Any]) -> set[int]:
    """SIGKILL `replica` while it holds notification claims; the ids it held."""
    mine = f"%:{replica.proc.pid}:%"
    query = (
        "SELECT coalesce(array_agg(id), '{}') FROM notifications "
        "WHERE claimed_by LIKE :mine AND status = 'queued'"
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if scalar(query, mine=mine):
            os.kill(replica.proc.pid, signal.SIGSTOP)  # frozen: it sends no more statements
            time.sleep(1.0)  # what it sent already (a commit) is done now
            held = set(scalar(query, mine=mine))
            if held:
                os.kill(replica.proc.pid, signal.SIGKILL)
                replica.proc.wait(10)
                return held
            os.kill(replica.proc.pid, signal.SIGCONT)
        time.sleep(0.01)
    raise AssertionError("the replica never held a claim")

"""Notifications against real HTTP receivers on loopback: a JSON webhook, a
Slack-compatible one, one that is down, one that is slow, one that fails once;
the events an execution's journal implies, each sent once across replicas,
failures recorded (`runbook history`, the service metric), the executor never
waiting for a receiver."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from vllm_runbook.runbooks.operate.cli import main
from vllm_runbook.runbooks.service.app import Credentials
from vllm_runbook.runbooks.service.notify import (
    NO_CHANGE,
    Notifier,
    Receiver,
    events_of,
)
from vllm_runbook.runbooks.service.telemetry import ServiceMetrics
from vllm_runbook.runbooks.store import Journal
from vllm_runbook.runbooks.store.models import ExecutionStatus

from tests.fake_agent import FakeAgent
from tests.service.conftest import Schedule
from tests.service.test_service_approvals import Replica, fire
from tests.service.test_service_webhooks import AUTH, TOKEN


class Hooks:
    """A receiver server: /ok answers 200, /flaky 500 once per event then 200,
    /slow answers after `release` is set (the client times out first), /hold
    answers after `release` too (for a client that waits)."""

    def __init__(self) -> None:
        self.bodies: dict[str, list[dict[str, Any]]] = {}
        self.seen_flaky: set[str] = set()
        self.release = threading.Event()
        self.holding = threading.Event()
        hooks = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers["Content-Length"])
                body = json.loads(self.rfile.read(length))
                path = self.path
                hooks.bodies.setdefault(path, []).append(
                    {**body, "_auth": self.headers.get("Authorization")}
                )
                status = 200
                if path == "/flaky":
                    key = body["event"]
                    status = 200 if key in hooks.seen_flaky else 500
                    hooks.seen_flaky.add(key)
                if path in ("/slow", "/hold"):
                    hooks.holding.set()
                    hooks.release.wait(30)
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def events(self, path: str) -> list[str]:
        return [b["event"] for b in self.bodies.get(path, [])]

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def closed_port() -> int:
    """A loopback port with nothing listening (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def hooks() -> Iterator[Hooks]:
    h = Hooks()
    yield h
    h.close()


@pytest.fixture
def replica(sqlite_url: str, tmp_path: Path) -> Iterator[Replica]:
    from tests.service.test_service_approvals import CONFIG

    cfg = tmp_path / "runbook.yaml"
    cfg.write_text(CONFIG)
    r = Replica(sqlite_url, cfg, FakeAgent.kv_bound(), Credentials(token=TOKEN, name="ann"))
    with r.client:
        yield r
    r.store.close()


def drain(notifier: Notifier) -> None:
    """Deliver what the last poll queued, here and now (the threads are not started)."""
    for receiver in notifier.receivers:
        notifier.send_queued(receiver)


def test_events_reach_the_receivers_and_failures_are_recorded(
    replica: Replica, hooks: Hooks, sqlite_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    down = f"http://127.0.0.1:{closed_port()}/hook"
    receivers = [
        Receiver("ops", "webhook", hooks.url + "/ok", token="hook-token"),
        Receiver("chat", "slack", hooks.url + "/ok-slack"),
        Receiver("flaky", "webhook", hooks.url + "/flaky"),
        Receiver("down", "webhook", down),
        Receiver("slow", "webhook", hooks.url + "/slow"),
    ]
    metrics = ServiceMetrics(receivers=[r.name for r in receivers])
    # The slow receiver answers only when the test ends: a short timeout makes
    # every attempt time out. The others get a timeout no load reaches (a
    # timeout after the receiver got the body would send it twice).
    notifier = Notifier(
        replica.store,
        receivers[:4],
        retries=2,
        backoff_s=0.01,
        timeout_s=60.0,
        claim_lease_s=240.0,
        page_url="http://runbook.example:8080",
        metrics=metrics,
    )
    slow = Notifier(
        replica.store, receivers[4:], retries=2, backoff_s=0.01, timeout_s=0.2, metrics=metrics
    )
    fire(replica)
    [waiting] = replica.store.pending_approvals()
    assert notifier.poll() + slow.poll() == 5  # one event, five receivers
    drain(notifier)
    drain(slow)
    assert hooks.events("/ok") == ["awaiting approval"]
    [first] = hooks.bodies["/ok"]
    assert first["_auth"] == "Bearer hook-token"
    assert (first["execution_id"], first["runbook"], first["alert"]) == (
        waiting.id,
        "oom-pressure",
        "VllmOOMPressure",
    )
    # Every message carries the event's key: the journal's, the same for every receiver.
    [awaiting] = replica.store.events_of_execution(waiting.id)
    assert (awaiting.event, first["key"]) == ("awaiting approval", awaiting.key)
    [slack] = hooks.bodies["/ok-slack"]
    assert set(slack) == {"text", "_auth"}
    assert slack["text"].splitlines() == [
        f"[AWAITING APPROVAL] oom-pressure on http://127.0.0.1:9 (execution #{waiting.id})",
        "Alert: VllmOOMPressure",
        "Reason: awaiting approval",
        f"http://runbook.example:8080/#execution-{waiting.id}",
        f"Event key: {awaiting.key}",
    ]

    approve = f"/api/executions/{waiting.id}/approve"
    assert replica.client.post(approve, headers=AUTH).is_success  # the token's name: ann
    assert replica.worker.tick() == 1
    assert notifier.poll() + slow.poll() == 10  # started, succeeded
    drain(notifier)
    drain(slow)
    assert hooks.events("/ok") == ["awaiting approval", "started", "succeeded"]
    assert [b["text"].splitlines()[0] for b in hooks.bodies["/ok-slack"]][1:] == [
        f"[STARTED] oom-pressure on http://127.0.0.1:9 (execution #{waiting.id})",
        f"[SUCCEEDED] oom-pressure on http://127.0.0.1:9 (execution #{waiting.id})",
    ]
    assert "Approved by ann" in hooks.bodies["/ok-slack"][2]["text"].splitlines()
    # Flaky: each event failed once, then got through on the retry.
    assert hooks.events("/flaky") == [e for e in hooks.events("/ok") for _ in range(2)]

    sent = replica.store.notifications([waiting.id])[waiting.id]
    fate = {(n.receiver, n.event): (n.status, n.attempts) for n in sent}
    for event in ("awaiting approval", "started", "succeeded"):
        assert fate["ops", event] == ("delivered", 1)
        assert fate["flaky", event] == ("delivered", 2)
        assert fate["down", event] == ("failed", 3)
        assert fate["slow", event] == ("failed", 3)
    errors = {(n.receiver, n.event): n.last_error for n in sent}
    assert errors["down", "started"] is not None
    assert errors["down", "started"].startswith("after 3 attempt(s): unreachable (ConnectError")
    # ReadTimeout (a loaded machine may even time out connecting: ConnectTimeout).
    assert errors["slow", "started"].startswith("after 3 attempt(s): timed out (")

    # Nothing new: a poll (or another replica's) claims nothing twice.
    assert notifier.poll() + slow.poll() == 0
    other = Notifier(replica.store, receivers, retries=0)
    assert other.poll() == 0

    v = metrics.notifications
    assert v.labels("ops", "delivered")._value.get() == 3
    assert v.labels("flaky", "delivered")._value.get() == 3
    assert v.labels("down", "failed")._value.get() == 3
    assert v.labels("down", "delivered")._value.get() == 0
    assert v.labels("slow", "failed")._value.get() == 3

    code, out, _ = cli(capsys, "history", "--db", sqlite_url)
    assert code == 0
    assert out.splitlines()[1].endswith("notification failed: down, slow")
    code, out, _ = cli(capsys, "history", str(waiting.id), "--db", sqlite_url)
    tail = out[out.index("Notifications") :].splitlines()
    assert tail[1:4] == [
        "  awaiting approval → ops: delivered",
        "  awaiting approval → chat: delivered",
        "  awaiting approval → flaky: delivered",
    ]
    assert tail[5].startswith("  awaiting approval → slow: failed (after 3 attempt(s): timed out (")
    notifier.stop()
    slow.stop()
    other.stop()


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_a_receiver_that_hangs_never_holds_up_the_executor(
    replica: Replica, hooks: Hooks, scheduled: Schedule
) -> None:
    receivers = [Receiver("hold", "webhook", hooks.url + "/hold")]
    notifier = Notifier(
        replica.store, receivers, retries=0, timeout_s=60.0, claim_lease_s=240.0, interval_s=0.05
    )
    scheduled(notifier)
    try:
        fire(replica)
        assert hooks.holding.wait(60)  # the receiver now holds "awaiting approval"
        [waiting] = replica.store.pending_approvals()
        assert replica.client.post(f"/api/executions/{waiting.id}/approve", headers=AUTH).is_success
        # The run completes while the receiver still holds the first delivery.
        assert replica.worker.tick() == 1
        assert replica.store.get_execution(waiting.id).status == ExecutionStatus.SUCCEEDED
        assert hooks.events("/hold") == ["awaiting approval"]
        hooks.release.set()
    finally:
        notifier.stop()


def test_the_events_of_each_outcome(sqlite_url: str) -> None:
    store = Journal(sqlite_url)

    def run(*statuses: str, **finish: Any) -> list[str]:
        record, _ = store.create_execution("oom-pressure", "http://e", trigger="cli", who="me")
        for status in statuses[:-1]:
            store.transition(record.id, status)
        store.transition(record.id, statuses[-1], finish.get("error"))
        if "verification" in finish:
            store.record_verification(record.id, finish["verification"])
        return events_of(store.get_execution(record.id))

    assert run(ExecutionStatus.RUNNING, ExecutionStatus.VERIFYING, ExecutionStatus.SUCCEEDED) == [
        "started",
        "succeeded",
    ]
    assert run(ExecutionStatus.RUNNING, ExecutionStatus.VERIFYING, ExecutionStatus.ROLLED_BACK) == [
        "started",
        "rolled back",
    ]
    assert run(
        ExecutionStatus.RUNNING,
        ExecutionStatus.VERIFYING,
        ExecutionStatus.FAILED,
        verification={"outcome": "not improved"},
    ) == [
        "started",
        NO_CHANGE,
    ]
    assert run(ExecutionStatus.RUNNING, ExecutionStatus.FAILED, error="engine gone") == [
        "started",
        "failed",
    ]
    assert run(ExecutionStatus.RUNNING, ExecutionStatus.FAILED, error="interrupted") == [
        "started",
        "interrupted",
    ]
    assert run(ExecutionStatus.RUNNING, ExecutionStatus.SUCCEEDED, ExecutionStatus.REVERTED) == [
        "started",
        "reverted",
    ]
    assert run("refused") == ["refused"]
    store.close()

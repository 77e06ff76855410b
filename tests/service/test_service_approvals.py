"""Approvals: an `approve`-mode execution waits for a person (CLI, API, page),
the journal says who answered, when and why; it expires; an approval after the
alert resolved runs nothing; two replicas never run one approved execution twice.
The engine is the in-memory agent of the service tests (knob writes counted)."""

from __future__ import annotations

import base64
import re
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from vllm_runbook.runbooks.model.config import load_config
from vllm_runbook.runbooks.model.spec import load_catalog as load_runbook_catalog
from vllm_runbook.runbooks.operate.cli import main
from vllm_runbook.runbooks.run.executor import Executor
from vllm_runbook.runbooks.service.app import Credentials, create_app
from vllm_runbook.runbooks.service.browser import BrowserPolicy
from vllm_runbook.runbooks.service.telemetry import ServiceMetrics
from vllm_runbook.runbooks.service.webhooks import Router
from vllm_runbook.runbooks.service.worker import Worker
from vllm_runbook.runbooks.store import Journal
from vllm_runbook.runbooks.store.approvals import RESOLVED_BEFORE_APPROVAL
from vllm_runbook.runbooks.store.models import ExecutionStatus

from tests.fake_agent import STARTUP, Clock, FakeAgent
from tests.service.test_service_webhooks import AUTH, TOKEN, payload
from tests.service.test_service_worker import WAITS

CONFIG = """\
engines:
  - name: engine-a
    agent: http://127.0.0.1:9
    labels: {instance: "10.1.2.3:8000"}
automation:
  oom-pressure: approve
approvals:
  timeout: 10m
"""
# What oom-pressure does to the in-memory agent: budget halved, max_num_seqs
# capped at half the KV capacity (24 running on a full cache), then handed
# over to the autopilot.
REMEDIATED = {**STARTUP, "max_num_batched_tokens": 256, "max_num_seqs": 12, "autopilot": True}
BASIC = {"Authorization": "Basic " + base64.b64encode(b"ann:s3cret").decode()}


class Replica:
    """One `runbook serve` (app + worker) over a shared store and one agent."""

    def __init__(
        self,
        url: str,
        cfg: Path,
        agent: FakeAgent,
        credentials: Credentials,
        *,
        protect_reads: bool = False,
        browser: BrowserPolicy | None = None,
    ) -> None:
        config = load_config(cfg)
        router = Router(
            config.engines,
            config.automation,
            {r.alert: r.runbook for r in config.load_rules()},
            frozenset(load_runbook_catalog()),
        )
        self.store = Journal(url)
        self.clock = Clock()
        executor = Executor(
            self.store,
            client_factory=lambda _url: agent,  # type: ignore[arg-type,return-value]
            sleep=self.clock.sleep,
            clock=self.clock,
        )
        timeout = config.approvals.timeout_seconds
        self.metrics = ServiceMetrics()
        self.worker = Worker(
            self.store, executor, waits=WAITS, approval_timeout_s=timeout, metrics=self.metrics
        )
        app = create_app(
            self.store,
            router,
            credentials,
            self.worker,
            approval_timeout_s=timeout,
            protect_reads=protect_reads,
            metrics=self.metrics,
            **({} if browser is None else {"browser": browser}),
        )
        self.client = TestClient(app, base_url="http://127.0.0.1")


@pytest.fixture
def cfg(tmp_path: Path) -> Path:
    path = tmp_path / "runbook.yaml"
    path.write_text(CONFIG)
    return path


@pytest.fixture
def replica(sqlite_url: str, cfg: Path) -> Iterator[Replica]:
    r = Replica(sqlite_url, cfg, FakeAgent.kv_bound(), Credentials(token=TOKEN))
    with r.client:
        yield r
    r.store.close()


def fire(r: Replica, status: str = "firing") -> Any:
    response = r.client.post("/webhooks/alertmanager", json=payload(status=status), headers=AUTH)
    assert response.status_code == 200, response.text
    return response.json()


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_approve_through_the_api_runs_it_and_the_journal_says_who(replica: Replica) -> None:
    [ex] = fire(replica)["executions"]
    assert ex["mode"] == "approve"
    assert replica.worker.tick() == 0  # waits for a person
    [waiting] = replica.store.pending_approvals()
    api = replica.client
    assert api.get("/api/pending").json()[0]["id"] == waiting.id
    approve = f"/api/executions/{waiting.id}/approve"
    assert api.post(approve, json={"note": "KV full"}).status_code == 401
    assert api.post("/api/executions/999/approve", headers=AUTH).status_code == 404
    # Who answered comes from the credentials, never from what the body claims.
    claimed = api.post(approve, json={"note": "KV full", "by": "ann"}, headers=AUTH)
    assert (claimed.status_code, claimed.json()) == (
        422,
        {
            "error": 'body: "by" is not accepted: the journal records who answered from the '
            "credentials (the basic-auth user, or the token's webhook.token_name)"
        },
    )
    assert replica.store.get_execution(waiting.id).decision is None
    r = api.post(approve, json={"note": "KV full"}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["message"] == (
        f"execution #{waiting.id} (oom-pressure on http://127.0.0.1:9) approved by webhook token; "
        "the service runs it"
    )
    assert replica.worker.tick() == 1
    done = replica.store.get_execution(waiting.id)
    assert (done.status, done.decision, done.decided_by, done.decision_note) == (
        ExecutionStatus.SUCCEEDED,
        "approved",
        "webhook token",  # the token's name (webhook.token_name)
        "KV full",
    )
    assert done.decided_at is not None and done.started_at is not None
    assert done.decided_at <= done.started_at
    assert replica.worker.tick() == 0
    assert replica.store.pending_approvals() == []
    # Answering again changes nothing, and says why.
    again = api.post(f"/api/executions/{waiting.id}/reject", headers=AUTH)
    assert again.status_code == 410
    assert again.json()["error"].startswith(
        f"execution #{waiting.id} (oom-pressure) was already approved by webhook token at "
    )


def test_reject_and_pending_through_the_cli(
    replica: Replica, sqlite_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    fire(replica)
    [waiting] = replica.store.pending_approvals()
    code, out, err = cli(capsys, "pending", "--db", sqlite_url)
    assert (code, err) == (0, "")
    header, row = out.splitlines()
    assert header.split() == ["ID", "RUNBOOK", "ENGINE", "FROM", "SINCE", "EXPIRES", "IN"]
    assert row.split()[:4] == [
        str(waiting.id),
        "oom-pressure",
        "http://127.0.0.1:9",
        "alertmanager:VllmOOMPressure",
    ]
    code, out, err = cli(
        capsys, "reject", str(waiting.id), "--note", "not now", "--by", "bob", "--db", sqlite_url
    )
    assert (code, err) == (0, "")
    assert out == (
        f"execution #{waiting.id} (oom-pressure on http://127.0.0.1:9) rejected by bob; "
        "nothing runs\n"
    )
    assert replica.worker.tick() == 0
    refused = replica.store.get_execution(waiting.id)
    assert (refused.status, refused.reason, refused.decision, refused.decided_by) == (
        ExecutionStatus.REFUSED,
        "rejected by bob: not now",
        "rejected",
        "bob",
    )
    assert replica.client.get("/api/pending").json() == []
    # A mistake is one line and a non-zero exit.
    assert cli(capsys, "approve", "4711", "--db", sqlite_url) == (
        2,
        "",
        "runbook: error: no execution with id 4711\n",
    )
    code, _, err = cli(capsys, "approve", str(waiting.id), "--db", sqlite_url)
    assert code == 1 and err.startswith(
        f"runbook: error: execution #{waiting.id} (oom-pressure) was already rejected by bob at "
    )
    assert cli(capsys, "pending", "--db", sqlite_url) == (
        0,
        "no executions awaiting approval\n",
        "",
    )


def test_an_unanswered_approval_expires_and_a_late_approval_runs_nothing(
    replica: Replica, sqlite_url: str, cfg: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fire(replica)
    [waiting] = replica.store.pending_approvals()
    timeout = 600.0  # the config's approvals.timeout
    assert replica.store.expire_approvals(timeout, now=waiting.created_at) == []
    later = waiting.created_at + timedelta(seconds=timeout)
    [expired] = replica.store.expire_approvals(timeout, now=later)
    assert (expired.id, expired.status, expired.reason) == (
        waiting.id,
        ExecutionStatus.REFUSED,
        "approval expired: nobody approved within 10 min",
    )
    code, out, err = cli(
        capsys, "approve", str(waiting.id), "--config", str(cfg), "--db", sqlite_url
    )
    assert (code, out) == (1, "")
    assert err == (
        f"runbook: error: execution #{waiting.id} (oom-pressure): approval expired: "
        "nobody approved within 10 min; nothing runs\n"
    )
    assert replica.worker.tick() == 0
    assert replica.store.get_execution(waiting.id).decision is None


def test_an_approval_past_its_time_is_expired_by_the_answer_itself(replica: Replica) -> None:
    fire(replica)
    [waiting] = replica.store.pending_approvals()
    late = waiting.created_at + timedelta(seconds=601)
    result = replica.store.decide(waiting.id, "approved", "ann", timeout_s=600, now=late)
    assert (result.outcome, result.record.status, result.record.decision) == (
        "too late",
        ExecutionStatus.REFUSED,
        None,
    )


def test_an_approval_after_the_alert_resolved_does_nothing_and_says_so(replica: Replica) -> None:
    fire(replica)
    [waiting] = replica.store.pending_approvals()
    fire(replica, "resolved")
    assert replica.worker.tick() == 0
    refused = replica.store.get_execution(waiting.id)
    assert (refused.status, refused.reason) == (ExecutionStatus.REFUSED, RESOLVED_BEFORE_APPROVAL)
    r = replica.client.post(f"/api/executions/{waiting.id}/approve", headers=AUTH)
    assert r.status_code == 410
    assert r.json()["error"] == (
        f"execution #{waiting.id} (oom-pressure): the alert resolved before approval; nothing runs"
    )
    assert replica.worker.tick() == 0
    assert replica.store.get_execution(waiting.id).status == ExecutionStatus.REFUSED
    refusals = replica.metrics.executions.labels(
        "oom-pressure", ExecutionStatus.REFUSED
    )._value.get()
    assert refusals == 1  # counted once, when the resolve refused it


def test_an_auto_execution_is_not_one_to_approve(sqlite_url: str, tmp_path: Path) -> None:
    cfg = tmp_path / "auto.yaml"
    cfg.write_text(CONFIG.replace("oom-pressure: approve", "oom-pressure: auto"))
    r = Replica(sqlite_url, cfg, FakeAgent.kv_bound(), Credentials(token=TOKEN))
    with r.client:
        fire(r)
        [row] = r.store.list_executions()
        answer = r.client.post(f"/api/executions/{row.id}/approve", headers=AUTH)
        assert answer.status_code == 409
        assert answer.json()["error"] == (
            f"execution #{row.id} (oom-pressure) is pending, not awaiting approval"
        )
    r.store.close()


def _two_replicas_one_approval(url: str, cfg: Path) -> None:
    agent = FakeAgent.kv_bound()
    a = Replica(url, cfg, agent, Credentials(token=TOKEN))
    b = Replica(url, cfg, agent, Credentials(token=TOKEN))
    with a.client, b.client:
        fire(a)
        fire(b)  # the HA peer's duplicate delivery
        [waiting] = a.store.pending_approvals()
        assert a.client.post(f"/api/executions/{waiting.id}/approve", headers=AUTH).is_success
        start = threading.Barrier(2)
        ran: dict[str, int] = {}

        def tick(name: str, replica: Replica) -> None:
            start.wait()
            ran[name] = replica.worker.tick()

        threads = [threading.Thread(target=tick, args=(n, r)) for n, r in (("a", a), ("b", b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(ran.values()) == [0, 1]
        assert agent.knobs == REMEDIATED
        assert agent.writes == [
            {"max_num_batched_tokens": 256},
            {"max_num_seqs": 12},
            {"autopilot": True},
        ]
        [done] = a.store.list_executions()
        assert (done.id, done.status) == (waiting.id, ExecutionStatus.SUCCEEDED)
        assert a.worker.tick() + b.worker.tick() == 0
    a.store.close()
    b.store.close()


def test_two_replicas_never_run_one_approved_execution_twice_sqlite(
    sqlite_url: str, cfg: Path
) -> None:
    _two_replicas_one_approval(sqlite_url, cfg)


@pytest.mark.service
def test_two_replicas_never_run_one_approved_execution_twice_postgres(
    pg_url: str, cfg: Path
) -> None:
    _two_replicas_one_approval(pg_url, cfg)


def test_page_off_loopback_needs_the_api_credentials_and_a_form_token(
    sqlite_url: str, cfg: Path
) -> None:
    basic = Credentials(username="ann", password="s3cret")
    r = Replica(sqlite_url, cfg, FakeAgent.kv_bound(), basic, protect_reads=True)
    with r.client as client:
        fire_body = payload()
        assert client.post("/webhooks/alertmanager", json=fire_body, headers=BASIC).is_success
        [waiting] = r.store.pending_approvals()
        denied = client.get("/")
        assert denied.status_code == 401
        assert denied.headers["www-authenticate"] == 'Basic realm="vllm-runbook"'
        assert client.get("/api/pending").status_code == 401
        page = client.get("/", headers=BASIC)
        assert page.status_code == 200
        assert f'id="approve-{waiting.id}"' in page.text
        assert "answers are recorded as ann" in page.text
        token = re.search(r'name="token" value="([^"]+)"', page.text)
        assert token is not None
        action = f"/ui/executions/{waiting.id}/approve"
        own = {"Origin": "http://127.0.0.1", **BASIC}
        # Another site's form (no token) cannot approve, even with the browser's credentials.
        forged = client.post(action, data={"note": "x"}, headers=own, follow_redirects=False)
        assert forged.status_code == 403
        no_auth = {"Origin": "http://127.0.0.1"}
        assert client.post(action, data={"token": token[1]}, headers=no_auth).status_code == 401
        ok = client.post(
            action,
            data={"token": token[1], "note": "go", "by": "mallory"},
            headers=own,
            follow_redirects=False,
        )
        assert ok.status_code == 303
        done = r.store.get_execution(waiting.id)
        # Basic auth names the person; a `by` field in the form changes nothing.
        assert (done.status, done.decision, done.decided_by, done.decision_note) == (
            ExecutionStatus.PENDING,
            "approved",
            "ann",
            "go",
        )
        assert r.worker.tick() == 1
        assert r.store.get_execution(waiting.id).status == ExecutionStatus.SUCCEEDED
    r.store.close()

"""Webhook → worker → executor against an agent in memory, and the metrics it
exports: one execution per episode, a repeated firing inside the cooldown
recorded as refused (nothing changed), the revert when the alert resolves.
Each metric is checked against the journal it is counted from."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from vllm_runbook.runbooks.model.config import ExecutorConfig, load_config
from vllm_runbook.runbooks.model.spec import load_catalog as load_runbook_catalog
from vllm_runbook.runbooks.run.executor import Executor
from vllm_runbook.runbooks.service.app import Credentials, create_app
from vllm_runbook.runbooks.service.telemetry import ServiceMetrics
from vllm_runbook.runbooks.service.webhooks import Router
from vllm_runbook.runbooks.service.worker import Worker
from vllm_runbook.runbooks.store import Journal
from vllm_runbook.runbooks.store.approvals import RESOLVED_BEFORE_RUN
from vllm_runbook.runbooks.store.models import STEP_APPLIED, ExecutionStatus

from tests.fake_agent import PRESSURE, STARTUP, URL, Clock, FakeAgent, kv_bound
from tests.service.test_service_webhooks import AUTH, CONFIG, TOKEN, payload

WAITS = ExecutorConfig(
    verify_seconds=5.0, condition_seconds=1.0, healthy_period_seconds=2.0, hold_seconds=0.0
)


class Service:
    def __init__(self, url: str, tmp_path: Path) -> None:
        cfg = tmp_path / "runbook.yaml"
        cfg.write_text(CONFIG)
        config = load_config(cfg)
        router = Router(
            config.engines,
            config.automation,
            {r.alert: r.runbook for r in config.load_rules()},
            frozenset(load_runbook_catalog()),
        )
        self.store = Journal(url)
        self.agent = FakeAgent.kv_bound()
        self.clock = Clock()
        executor = Executor(
            self.store,
            client_factory=lambda _url: self.agent,  # type: ignore[arg-type,return-value]
            sleep=self.clock.sleep,
            clock=self.clock,
        )
        self.metrics = ServiceMetrics(engine_names={URL: "engine-a"})
        self.worker = Worker(self.store, executor, waits=WAITS, metrics=self.metrics)
        app = create_app(
            self.store, router, Credentials(token=TOKEN), self.worker, metrics=self.metrics
        )
        self.client = TestClient(app, base_url="http://127.0.0.1")

    def deliver(self, body: dict[str, Any], headers: dict[str, str] = AUTH) -> Any:
        return self.client.post("/webhooks/alertmanager", json=body, headers=headers)

    def value(self, name: str, **labels: str) -> float:
        """A sample from GET /metrics (0 when absent), as Prometheus would read it."""
        text = self.client.get("/metrics").text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name and s.labels == labels:
                    return float(s.value)
        return 0.0


@pytest.fixture
def service(sqlite_url: str, tmp_path: Path) -> Iterator[Service]:
    svc = Service(sqlite_url, tmp_path)
    with svc.client:
        yield svc
    svc.store.close()


def firing(starts_at: datetime, status: str = "firing") -> dict[str, Any]:
    body = payload(status=status, fingerprint="oom-1")
    body["alerts"][0]["startsAt"] = starts_at.isoformat().replace("+00:00", "Z")
    return body


def test_metrics_count_webhooks_by_status_and_rejection_reason(service: Service) -> None:
    starts = datetime.now(UTC)
    assert service.deliver(firing(starts)).status_code == 200
    assert service.deliver(firing(starts)).status_code == 200  # a redelivery
    assert service.deliver(firing(starts, "resolved")).status_code == 200
    assert service.deliver(firing(starts), {"Authorization": "Bearer nope"}).status_code == 401
    bad = firing(starts)
    bad["version"] = "3"
    assert service.deliver(bad).status_code == 422
    r = service.client.post("/webhooks/alertmanager", content=b"{", headers=AUTH)
    assert r.status_code == 400
    v = service.value
    assert v("vllm_runbook_service_webhooks_received_total", status="firing") == 2
    assert v("vllm_runbook_service_webhooks_received_total", status="resolved") == 1
    assert v("vllm_runbook_service_webhooks_rejected_total", reason="auth") == 1
    assert v("vllm_runbook_service_webhooks_rejected_total", reason="malformed") == 2
    assert v("vllm_runbook_service_webhooks_rejected_total", reason="store_down") == 0
    # One episode, two deliveries: one execution created.
    assert v("vllm_runbook_service_executions_total", runbook="oom-pressure", status="pending") == 1


def test_firing_runs_once_repeat_in_cooldown_is_refused_resolve_reverts(service: Service) -> None:
    agent, worker, v = service.agent, service.worker, service.value
    first = datetime.now(UTC) - timedelta(seconds=30)
    assert service.deliver(firing(first)).status_code == 200
    assert worker.tick() == 1
    [done] = service.store.list_executions()
    assert (done.status, done.trigger, done.alert_starts_at) == (
        ExecutionStatus.SUCCEEDED,
        "alert",
        first,
    )
    # Halved, capped at half the KV capacity (24 running on a full cache), then
    # handed over to the autopilot.
    assert agent.knobs == {
        **STARTUP,
        "max_num_batched_tokens": 256,
        "max_num_seqs": 12,
        "autopilot": True,
    }
    assert [s.action for s in done.steps if s.status == STEP_APPLIED] == [
        "scale_max_num_batched_tokens",
        "set_max_num_seqs",
        "set_autopilot",
    ]
    assert done.verification is not None and done.verification["outcome"] == "improved"
    assert done.verification["deadline_seconds"] == WAITS.verify_seconds
    [condition] = [s for s in done.steps if s.action == "set_max_num_seqs"]
    assert condition.params["waited_seconds"] == WAITS.condition_seconds
    assert worker.tick() == 0  # nothing pending: the episode ran once

    # The same alert fires again (a new episode: new startsAt) inside the cooldown,
    # preemptions going on (were they gone, there would be nothing to improve).
    agent.script = lambda knobs: dict(PRESSURE)
    second = datetime.now(UTC)
    assert service.deliver(firing(second)).status_code == 200
    writes = len(agent.writes)
    assert worker.tick() == 1
    refused = service.store.list_executions()[0]
    assert refused.status == ExecutionStatus.REFUSED and refused.alert_starts_at == second
    assert refused.reason is not None and refused.reason.startswith("cooldown: oom-pressure ran")
    assert len(agent.writes) == writes  # recorded, not executed
    assert refused.steps == ()
    agent.script = kv_bound

    # The first episode resolves: its changes are reverted (stepwise: 50 %, then
    # all; the autopilot goes off at the first stage).
    assert service.deliver(firing(first, "resolved")).status_code == 200
    worker.tick()
    assert agent.knobs == STARTUP
    assert service.store.get_execution(done.id).status == ExecutionStatus.REVERTED
    revert = service.store.list_executions()[0]
    assert (revert.reverts_id, revert.status) == (done.id, ExecutionStatus.SUCCEEDED)
    assert agent.writes[-2:] == [
        {"max_num_batched_tokens": 384, "max_num_seqs": 22, "autopilot": False},
        {"max_num_batched_tokens": 512, "max_num_seqs": 32},
    ]

    # The metrics say what the journal says.
    runs = "vllm_runbook_service_executions_total"
    assert v(runs, runbook="oom-pressure", status="pending") == 2
    assert v(runs, runbook="oom-pressure", status=ExecutionStatus.SUCCEEDED) == 1
    assert v(runs, runbook="oom-pressure", status=ExecutionStatus.REFUSED) == 1
    assert v(runs, runbook="oom-pressure", status=ExecutionStatus.REVERTED) == 1
    knobs = "vllm_runbook_service_knob_changes_total"
    # Applied: budget, max_num_seqs. Reverted in two stages: both knobs each time.
    assert v(knobs, engine="engine-a", knob="max_num_batched_tokens") == 3
    assert v(knobs, engine="engine-a", knob="max_num_seqs") == 3
    assert v(knobs, engine="engine-a", knob="policy") == 0
    first_change = done.steps[0]
    assert first_change.action == "scale_max_num_batched_tokens"
    assert first_change.finished_at is not None
    expected = (first_change.finished_at - first).total_seconds()
    delay = "vllm_runbook_service_detection_to_action_seconds"
    assert v(delay + "_count", runbook="oom-pressure") == 1  # the refusal changed nothing
    assert v(delay + "_sum", runbook="oom-pressure") == pytest.approx(expected, abs=1e-6)
    assert 30 <= expected < 40


def test_an_automatic_execution_whose_alert_resolved_before_it_ran_is_refused(
    service: Service,
) -> None:
    """The worker was busy (another execution) while an alert fired and
    resolved: its queued execution must not change the engine afterwards, when
    the revert on resolve has already been and gone (seen in the demo: a policy
    switched to FCFS after its alert resolved, never switched back)."""
    starts = datetime.now(UTC) - timedelta(seconds=5)
    assert service.deliver(firing(starts)).status_code == 200
    assert service.deliver(firing(starts, "resolved")).status_code == 200
    assert service.worker.tick() == 0
    [refused] = service.store.list_executions()
    assert (refused.status, refused.reason) == (
        ExecutionStatus.REFUSED,
        RESOLVED_BEFORE_RUN,
    )
    assert service.agent.writes == [] and service.agent.knobs == STARTUP
    assert service.worker.tick() == 0


def test_awaiting_approval_is_left_for_a_person(service: Service) -> None:
    body = payload("VllmLatencySpike", "latency-spike", fingerprint="lat-1")
    assert service.deliver(body).status_code == 200
    assert service.worker.tick() == 0
    [row] = service.store.list_executions()
    assert (row.status, row.reason) == ("pending", "awaiting approval")
    assert service.agent.writes == []


def test_metrics_of_the_rules_engine_are_exported_at_zero(sqlite_url: str) -> None:
    metrics = ServiceMetrics()
    metrics.set_firing(["VllmOOMPressure", "VllmLatencySpike"], {"VllmOOMPressure": 1})
    from prometheus_client import generate_latest

    text = generate_latest(metrics.registry).decode()
    assert 'vllm_runbook_service_incidents_firing{alert="VllmOOMPressure"} 1.0' in text
    assert 'vllm_runbook_service_incidents_firing{alert="VllmLatencySpike"} 0.0' in text
    assert "vllm_runbook_service_rule_evaluation_seconds_count 0.0" in text
    metrics.clear_firing()  # no longer the leader: another replica reports them
    text = generate_latest(metrics.registry).decode()
    assert "vllm_runbook_service_incidents_firing{" not in text


def test_known_label_combinations_start_at_zero() -> None:
    """Prometheus' increase()/changes() miss an event whose series first appears
    at 1: every runbook x status, engine x knob and scrape target x reason the
    service knows is exported at 0 before anything happens."""
    from prometheus_client import generate_latest
    from vllm_runbook.runbooks.service.telemetry import COUNTED_STATUSES

    metrics = ServiceMetrics(
        engine_names={URL: "engine-a"},
        runbooks=["oom-pressure", "latency-spike"],
        scrape_targets=[URL + "/metrics"],
    )
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
        for s in family.samples
    }

    def zero(name: str, **labels: str) -> bool:
        return samples.get((name, tuple(sorted(labels.items())))) == 0.0

    for runbook in ("oom-pressure", "latency-spike"):
        for status in COUNTED_STATUSES:
            assert zero("vllm_runbook_service_executions_total", runbook=runbook, status=status)
        assert zero("vllm_runbook_service_detection_to_action_seconds_count", runbook=runbook)
    for knob in ("max_num_batched_tokens", "max_num_seqs", "policy"):
        assert zero("vllm_runbook_service_knob_changes_total", engine="engine-a", knob=knob)
    for reason in ("unreachable", "http_status", "parse"):
        assert zero(
            "vllm_runbook_service_scrape_errors_total", target=URL + "/metrics", reason=reason
        )
    for status in ("firing", "resolved"):
        assert zero("vllm_runbook_service_webhooks_received_total", status=status)
    # Nothing invented: only what was named.
    runbooks = {dict(k[1])["runbook"] for k in samples if k[0].endswith("executions_total")}
    assert runbooks == {"oom-pressure", "latency-spike"}


def test_embedded_evaluator_handoff_runs_once_and_reverts_on_resolve(service: Service) -> None:
    from vllm_runbook.rules.config import EngineConfig
    from vllm_runbook.rules.incidents import IncidentEvent
    from vllm_runbook.rules.remediation import Handoff
    from vllm_runbook.runbooks.service.worker import ExecutorHook

    first_seen = time.time() - 12.0
    incident = IncidentEvent(
        alert="VllmOOMPressure",
        severity="critical",
        runbook="oom-pressure",
        engine=("engine-a", "m", "0"),
        state="firing",
        value=1.0,
        first_seen=first_seen,
        last_seen=first_seen + 10,
        at=first_seen + 10,
        fired_at=first_seen + 2,
    )
    handoff = Handoff(
        incident, "auto", "engine-a", EngineConfig(name="engine-a", agent=URL), "episode-1"
    )
    hook = ExecutorHook(service.store, service.worker)
    hook.on_firing(handoff)
    hook.on_firing(handoff)  # evaluated again (another replica, a retry): same episode
    assert service.worker.tick() == 1
    [done] = service.store.list_executions()
    assert (done.status, done.trigger, done.who) == (
        ExecutionStatus.SUCCEEDED,
        "alert",
        "rules:VllmOOMPressure",
    )
    # startsAt: when it fired, as Prometheus' startsAt (FiredAt) on the other path.
    assert done.alert_starts_at == datetime.fromtimestamp(first_seen + 2, UTC)
    assert service.agent.knobs["max_num_batched_tokens"] == 256
    hook.on_resolved(handoff)
    service.worker.tick()
    assert service.agent.knobs == STARTUP
    assert service.store.get_execution(done.id).status == ExecutionStatus.REVERTED
    pending = "vllm_runbook_service_executions_total"
    assert service.value(pending, runbook="oom-pressure", status="pending") == 1


def test_serve_wires_the_inventory_into_the_executor_and_the_metrics(tmp_path: Path) -> None:
    """`runbook serve`'s assembly: the inventory's `vllm:` URL reaches the executor
    (warm-up requests go there), and the metrics start at 0 for its engines."""
    from vllm_runbook.runbooks.service.serve_cli import build

    (tmp_path / "token").write_text(TOKEN + "\n")
    cfg = tmp_path / "runbook.yaml"
    cfg.write_text(
        "engines:\n"
        "  - {name: engine-a, agent: 'http://127.0.0.1:9/', vllm: 'http://127.0.0.1:8000'}\n"
        "  - {name: engine-b, agent: 'http://127.0.0.1:10'}\n"
        f"database: sqlite:///{tmp_path / 'j.db'}\n"
        "webhook: {token_file: token}\n"
    )
    service = build(str(cfg), None, "127.0.0.1")
    store = service.store
    try:
        assert service.worker is not None
        assert service.worker.executor.api_urls == {"http://127.0.0.1:9": "http://127.0.0.1:8000"}
        text = TestClient(service.app, base_url="http://127.0.0.1").get("/metrics").text
        assert (
            'vllm_runbook_service_executions_total{runbook="warmup",status="succeeded"} 0.0' in text
        )
        assert (
            'vllm_runbook_service_knob_changes_total{engine="engine-b",knob="policy"} 0.0' in text
        )
        assert 'target="http://127.0.0.1:9/metrics"' in text  # the evaluator's scrape errors
    finally:
        store.close()


def test_a_finding_back_after_its_revert_is_reapplied_counted_and_the_next_revert_held(
    service: Service,
) -> None:
    """Through the webhook and the worker: fix, resolve (hold 0: reverted at
    once), the same alert again within the watch (oom-pressure's verification
    deadline, 120 s): the last stage that held is re-applied, counted, and
    its own resolution holds for a person (a third turn within the hour)."""
    agent, worker, v = service.agent, service.worker, service.value
    first = datetime.now(UTC) - timedelta(seconds=30)
    assert service.deliver(firing(first)).status_code == 200
    assert worker.tick() == 1
    [done] = service.store.list_executions()
    assert done.status == ExecutionStatus.SUCCEEDED
    holding = "vllm_runbook_service_executions_holding"
    assert service.deliver(firing(first, "resolved")).status_code == 200
    worker.tick()
    assert agent.knobs == STARTUP
    revert = service.store.list_executions()[0]
    assert (revert.reverts_id, revert.who, revert.premature) == (done.id, "hold", False)
    # Back 5 s after the revert: preemptions again.
    agent.script = lambda knobs: dict(PRESSURE)
    again = (revert.finished_at or datetime.now(UTC)) + timedelta(seconds=5)
    assert service.deliver(firing(again)).status_code == 200
    assert worker.tick() == 1
    reapplied = service.store.list_executions()[0]
    assert reapplied.status == ExecutionStatus.SUCCEEDED
    assert [s.action for s in reapplied.steps] == ["reapply_knobs"]
    # The last stage that held: what the revert's final (100 %) stage replaced.
    assert agent.knobs == {**STARTUP, "max_num_batched_tokens": 384, "max_num_seqs": 22}
    assert service.store.get_execution(revert.id).premature
    premature = "vllm_runbook_service_reverts_premature_total"
    assert v(premature, engine="engine-a", runbook="oom-pressure") == 1
    # Its alert resolves: fix, revert, re-apply this hour: a person decides.
    agent.script = kv_bound
    assert service.deliver(firing(again, "resolved")).status_code == 200
    worker.tick()
    held = service.store.get_execution(reapplied.id)
    assert held.display_status == "holding" and held.hold_for_person
    assert agent.knobs == {**STARTUP, "max_num_batched_tokens": 384, "max_num_seqs": 22}
    worker.tick()
    assert v(holding, engine="engine-a", runbook="oom-pressure") == 1
    page = service.client.get("/").text
    assert f'id="holding-{reapplied.id}"' in page and f'id="release-{reapplied.id}"' in page

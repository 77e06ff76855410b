"""Advisory mode's pieces without an engine: the would-be knob values computed
from /v1/state against the agent's own answer (EngineControl on a fake
scheduler), the configuration's and the runbooks' `mode`, the events and the
status an advised execution shows, and the autopilot's advisory switch."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from vllm_runbook.collector.agent_api import Bounds, Knobs
from vllm_runbook.collector.autopilot import Autopilot, parse_mode
from vllm_runbook.collector.control import ControlError, EngineControl, parse_command
from vllm_runbook.collector.settings import CollectorSettings
from vllm_runbook.collector.state import _bound
from vllm_runbook.runbooks.engine.client import CommandRefused
from vllm_runbook.runbooks.model.config import load_config
from vllm_runbook.runbooks.model.spec import load_catalog
from vllm_runbook.runbooks.run.advisory import AdvisoryAgent, would_change
from vllm_runbook.runbooks.store import ExecutionRecord
from vllm_runbook.runbooks.store.events import derive_events

from tests.unit.test_control_units import fake_scheduler


def state_of(control: EngineControl) -> Any:
    """The parts of /v1/state the advice reads, as the agent builds them."""
    bounds = control.bounds()
    return SimpleNamespace(
        knobs=Knobs(**control.knobs()),
        startup=Knobs(**control.startup),
        bounds=Bounds(
            max_num_batched_tokens=_bound(bounds["max_num_batched_tokens"]),
            max_num_seqs=_bound(bounds["max_num_seqs"]),
        ),
    )


REQUESTS: list[dict[str, Any]] = [
    {"scale_max_num_batched_tokens": 0.5},
    {"scale_max_num_batched_tokens": 0.01, "clamp": True},
    {"scale_max_num_batched_tokens": 0.01},
    {"max_num_seqs": 16},
    {"max_num_seqs": 40},
    {"max_num_seqs": 40, "clamp": True},
    {"max_num_seqs": 0, "clamp": True},
    {"max_num_batched_tokens": 16},
    {"max_num_batched_tokens": 16, "max_num_seqs": 8},
    {"max_num_batched_tokens": 1024, "clamp": True},
    {"max_num_seqs": 24, "autopilot": True},
    {"autopilot": True},
    {"policy": "priority"},
    {"autopilot_target": 0.8},
]


@pytest.mark.parametrize("first", [None, {"max_num_seqs": 8, "max_num_batched_tokens": 64}])
@pytest.mark.parametrize(
    "request_", REQUESTS, ids=lambda r: ",".join(f"{k}={v}" for k, v in r.items())
)
def test_the_would_be_values_are_the_agents_dry_run_answer(
    first: dict[str, Any] | None, request_: dict[str, Any]
) -> None:
    control = EngineControl(fake_scheduler(), current_step=lambda: 41)
    if first is not None:
        control.submit(parse_command(first), wait_s=1)
    values = {k: v for k, v in request_.items() if k != "clamp"}
    clamp = bool(request_.get("clamp"))
    try:
        agent = control.submit(parse_command({**request_, "dry_run": True}), wait_s=1)
    except ControlError as refused:
        with pytest.raises(CommandRefused) as ours:
            would_change(state_of(control), values, clamp)
        assert str(ours.value).split(":")[0] == str(refused).split(":")[0]
        return
    ours = would_change(state_of(control), values, clamp)
    assert ours.would_be == agent.would_be
    assert ours.changes == agent.changes
    assert ours.clamped == agent.clamped
    assert ours.after == ours.before == agent.before  # nothing changed


class _ReadOnly:
    """An Agent whose writes fail the test: the advisory agent must send none."""

    url, timeout = "http://127.0.0.1:1", 1.0

    def __init__(self, state: Any) -> None:
        self._state = state

    def state(self, since_step: int | None = None, episode_seconds: float | None = None) -> Any:
        return self._state

    def set_knobs(self, clamp: bool = False, dry_run: bool = False, **values: Any) -> Any:
        raise AssertionError("advisory mode sent a knob change")

    def restore(self, dry_run: bool = False) -> Any:
        raise AssertionError("advisory mode sent a restore")


def test_the_advisory_agent_sends_nothing_and_refuses_a_real_write() -> None:
    control = EngineControl(fake_scheduler(), current_step=lambda: 41)
    agent = AdvisoryAgent(_ReadOnly(state_of(control)))  # type: ignore[arg-type]
    answer = agent.set_knobs(dry_run=True, max_num_seqs=8)
    assert answer.would_be is not None and answer.would_be.max_num_seqs == 8
    restored = agent.restore(dry_run=True)
    assert restored.would_be == restored.before  # at its startup values already
    with pytest.raises(CommandRefused, match="advisory mode: nothing is changed"):
        agent.set_knobs(max_num_seqs=8)
    with pytest.raises(CommandRefused, match="advisory mode: nothing is changed"):
        agent.restore()
    with pytest.raises(CommandRefused, match="nothing to change"):
        agent.set_knobs(dry_run=True)


def test_mode_in_the_configuration_and_in_a_runbook(tmp_path: Path) -> None:
    catalog = load_catalog()
    assert {spec.mode for spec in catalog.values()} == {"act"}
    assert load_config(None).advisory(catalog) == frozenset()
    cfg = tmp_path / "runbook.yaml"
    cfg.write_text("mode: advisory\n")
    assert load_config(cfg).advisory(catalog) == frozenset(catalog)
    one = {
        **catalog,
        "oom-pressure": catalog["oom-pressure"].model_copy(update={"mode": "advisory"}),
    }
    assert load_config(None).advisory(one) == {"oom-pressure"}
    cfg.write_text("mode: maybe\n")
    with pytest.raises(Exception, match="mode"):
        load_config(cfg)


def _record(**kw: Any) -> ExecutionRecord:
    now = datetime(2026, 12, 5, tzinfo=UTC)
    fields: dict[str, Any] = {
        "id": 1,
        "runbook": "oom-pressure",
        "engine": "http://e",
        "trigger": "alert",
        "who": "rules:VllmOOMPressure",
        "alert_fingerprint": "f",
        "alert_starts_at": now,
        "dry_run": True,
        "status": "succeeded",
        "reason": "advisory: would act",
        "error": None,
        "checks": None,
        "verification": None,
        "reverts_id": None,
        "hostname": None,
        "pid": None,
        "created_at": now,
        "started_at": now,
        "finished_at": now,
    }
    return ExecutionRecord(**{**fields, **kw})


def test_an_advised_execution_shows_advised_holds_nothing_and_has_one_event() -> None:
    advised = _record()
    assert (advised.advised, advised.display_status) == (True, "advised")
    resolved = _record(hold_since=datetime(2026, 12, 5, 0, 5, tzinfo=UTC))
    assert (resolved.holding, resolved.display_status) == (False, "advised")
    cli_dry_run = _record(trigger="cli", alert_fingerprint=None, alert_starts_at=None)
    assert (cli_dry_run.advised, cli_dry_run.display_status) == (False, "succeeded")

    def events(r: ExecutionRecord) -> list[str]:
        return derive_events(
            dry_run=r.dry_run,
            reverts_id=r.reverts_id,
            reason=r.reason,
            decision=r.decision,
            started_at=r.started_at,
            status=r.status,
            error=r.error,
            verification=r.verification,
            hold_since=r.hold_since,
            trigger=r.trigger,
        )

    assert events(advised) == events(resolved) == ["advised"]
    assert events(_record(status="running")) == []
    assert events(cli_dry_run) == []


def test_the_autopilot_advisory_switch() -> None:
    assert parse_mode("advisory") == (False, True)
    assert parse_mode(" Advisory ") == (False, True)
    assert parse_mode("on") == (True, False)
    assert parse_mode("off") == (False, False)
    with pytest.raises(ValueError, match="on or off"):
        parse_mode("maybe")
    settings = CollectorSettings.from_env({"VLLM_RUNBOOK_AUTOPILOT": "advisory"})
    assert (settings.autopilot, settings.autopilot_advisory) == (False, True)

    pilot = Autopilot()
    pilot.advise(32, 0)
    assert (pilot.enabled, pilot.advisory, pilot.observing) == (False, True, True)
    # A preemption at the limit it reasons from (its own): the cut it would make.
    decision = pilot.observe(10, 32, 32, 30, 5, 2, 1.0)
    assert decision is not None and (decision.limit, decision.reason) == (25, "preemption")
    assert pilot.snapshot()["limit"] == 25 and pilot.snapshot()["advisory"] is True
    pilot.enable(32, 11)  # switched on: it acts, and advises no more
    assert (pilot.enabled, pilot.advisory) == (True, False)


def test_both_doors_record_advice_that_waits_for_no_one(tmp_path: Path) -> None:
    """An `approve` runbook in advisory mode: the webhook's and the embedded
    evaluator's executions are dry runs that wait for no person."""
    from vllm_runbook.rules.config import Automation, EngineConfig
    from vllm_runbook.runbooks.service.alertmanager import WebhookPayload
    from vllm_runbook.runbooks.service.webhooks import Router, ingest
    from vllm_runbook.runbooks.service.worker import ExecutorHook
    from vllm_runbook.runbooks.store import Journal, upgrade

    url = f"sqlite:///{tmp_path / 'runbook.db'}"
    upgrade(url)
    store = Journal(url)
    engine = EngineConfig(name="e0", agent="http://127.0.0.1:9360", labels={"instance": "e0"})
    automation = Automation.model_validate({"oom-pressure": "approve"})
    advisory = frozenset({"oom-pressure"})
    router = Router(
        engines=(engine,),
        automation=automation,
        alert_runbooks={"VllmOOMPressure": "oom-pressure"},
        known_runbooks=frozenset({"oom-pressure"}),
        advisory=advisory,
    )
    alert = {
        "status": "firing",
        "labels": {"alertname": "VllmOOMPressure", "instance": "e0"},
        "startsAt": "2026-12-05T10:00:00Z",
        "fingerprint": "f1",
    }
    raw = {"version": "4", "groupKey": "g", "status": "firing", "receiver": "r", "alerts": [alert]}
    [created] = ingest(store, router, WebhookPayload.model_validate(raw), raw).executions
    assert created["mode"] == "advisory"
    woken: list[bool] = []
    worker = SimpleNamespace(metrics=None, wake=lambda: woken.append(True))
    hook = ExecutorHook(store, worker, advisory)  # type: ignore[arg-type]
    handoff = SimpleNamespace(
        engine=engine,
        engine_name="e0",
        runbook="oom-pressure",
        mode="approve",
        episode="VllmOOMPressure/e0/1",
        incident=SimpleNamespace(alert="VllmOOMPressure", fired_at=1.8e9, first_seen=1.8e9),
    )
    hook.on_firing(handoff)
    records = store.list_executions()
    assert sorted((r.who, r.dry_run, r.reason, r.status) for r in records) == [
        ("alertmanager:VllmOOMPressure", True, None, "pending"),
        ("rules:VllmOOMPressure", True, None, "pending"),
    ]
    assert [r.id for r in store.runnable_executions(after_id=0, limit=10)] == sorted(
        r.id for r in records
    )
    assert woken == [True]
    store.close()

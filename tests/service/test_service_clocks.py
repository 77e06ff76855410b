"""Clocks from outside: an alert's startsAt that gives no sensible
detection-to-action time (year 1, an hour ahead of the action) is counted apart,
not averaged into vllm_runbook_service_detection_to_action_seconds."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from prometheus_client import CollectorRegistry
from vllm_runbook.runbooks.service.telemetry import ServiceMetrics
from vllm_runbook.runbooks.store import ExecutionRecord, StepRecord
from vllm_runbook.runbooks.store.models import STEP_APPLIED, ExecutionStatus

ACTED = datetime(2026, 12, 5, 12, 0, 0, tzinfo=UTC)


def acted_on(starts_at: datetime, execution_id: int) -> ExecutionRecord:
    """A succeeded alert execution whose first step changed a knob at ACTED."""
    step = StepRecord(
        id=execution_id,
        execution_id=execution_id,
        ordinal=0,
        action="set_max_num_seqs",
        params={},
        before={"max_num_seqs": 64},
        after={"max_num_seqs": 32},
        status=STEP_APPLIED,
        error=None,
        applied_at_step=10,
        started_at=ACTED - timedelta(seconds=1),
        finished_at=ACTED,
    )
    return ExecutionRecord(
        id=execution_id,
        runbook="oom-pressure",
        engine="http://127.0.0.1:9",
        trigger="alert",
        who="alertmanager:VllmOOMPressure",
        alert_fingerprint=f"fp-{execution_id}",
        alert_starts_at=starts_at,
        dry_run=False,
        status=ExecutionStatus.SUCCEEDED,
        reason=None,
        error=None,
        checks=None,
        verification=None,
        reverts_id=None,
        hostname=None,
        pid=None,
        created_at=ACTED,
        started_at=ACTED,
        finished_at=ACTED,
        steps=(step,),
    )


def test_only_sensible_detection_to_action_times_are_observed() -> None:
    registry = CollectorRegistry()
    metrics = ServiceMetrics(registry, runbooks=["oom-pressure"])
    starts = [
        datetime(1, 1, 1, tzinfo=UTC),  # year 1: 2025 years
        ACTED - timedelta(days=2),  # older than a day
        ACTED + timedelta(hours=1),  # an hour after the action
        ACTED + timedelta(seconds=30),  # within the clock skew allowed: 0
        ACTED - timedelta(seconds=45),
    ]
    for i, starts_at in enumerate(starts, start=1):
        metrics.execution_finished(acted_on(starts_at, i))

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"runbook": "oom-pressure", **labels})

    delay = "vllm_runbook_service_detection_to_action_seconds"
    assert value(delay + "_count") == 2
    assert value(delay + "_sum") == 45.0  # 0 + 45: no 2000-year average
    apart = "vllm_runbook_service_detection_to_action_unmeasured_total"
    assert value(apart, reason="starts_at_too_old") == 2
    assert value(apart, reason="starts_at_after_action") == 1

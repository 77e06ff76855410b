"""Incident events and where they go.

The evaluator emits one IncidentEvent per state change of an (alert, engine)
pair. Sinks implement the IncidentSink Protocol: MemoryIncidentSink here (tests,
no store), SqlIncidentSink (vllm_runbook.runbooks.service.sql_sink) onto the runbook store, and the
Dispatcher (vllm_runbook.rules.remediation) that records, notifies and hands off.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

from vllm_runbook.rules.window import EngineKey

State = Literal["pending", "firing", "resolved", "inactive"]


@dataclass(frozen=True)
class IncidentEvent:
    alert: str
    severity: str
    runbook: str | None
    engine: EngineKey  # (instance, model_name, engine)
    state: State  # pending: true, waiting out `for`; inactive: pending that cleared
    value: float  # the condition's value at `at` (its last value when resolving)
    first_seen: float  # when the condition became true (Prometheus' activeAt)
    last_seen: float  # the latest evaluation at which it was true
    at: float  # evaluation time of this change
    fired_at: float | None = None
    labels: Mapping[str, str] = field(default_factory=dict)  # alertname, engine and rule labels
    summary: str = ""
    description: str = ""


@dataclass(frozen=True)
class OpenAlert:
    """An alert the evaluator holds open now (pending or firing), without templates."""

    alert: str
    severity: str
    engine: EngineKey
    state: State
    value: float
    first_seen: float
    last_seen: float


class IncidentSink(Protocol):
    def record(self, event: IncidentEvent) -> None: ...


def engine_name(engine: EngineKey) -> str:
    """The engine as the store and the executor name it: its inventory name (the
    `instance` label), with the DP rank appended for ranks other than 0."""
    instance, _model, rank = engine
    return instance if rank == "0" else f"{instance}/dp{rank}"


class MemoryIncidentSink:
    """Keeps every event in a list (tests, a single-process service without a store)."""

    def __init__(self) -> None:
        self.events: list[IncidentEvent] = []

    def record(self, event: IncidentEvent) -> None:
        self.events.append(event)

    def of(self, alert: str, state: State | None = None) -> list[IncidentEvent]:
        return [e for e in self.events if e.alert == alert and (state is None or e.state == state)]

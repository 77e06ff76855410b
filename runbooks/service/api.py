"""The service's API (`/api/*`) as models: one description for both sides.

`runbook serve` answers with these models (service/app.py declares them as its
routes' return types, so its OpenAPI document carries their schemas); `runbook
top --server` and the demo's event feed parse the answers with them.

    GET  /api/executions                      → Executions       (newest first)
    GET  /api/incidents                       → Incidents
    GET  /api/pending                         → PendingApprovals (newest first, paged)
    GET  /api/engines                         → Engines          (the inventory)
    GET  /api/engines/state                   → EngineStates     (each agent's state, or why not)
    GET  /api/whoami                          → WhoAmI
    POST /api/executions/{id}/approve|reject  → Decision
    any refusal                               → ApiError         (400, 401, 404, 409, 410, 422, 503)

The JSON is the journal's `to_dict` shapes (`runbook history --json` prints the
same): an answer is built from the store's records through `to_dict`, field for
field, so the models change nothing a client sees. Times are the journal's ISO
8601 strings (aware, UTC), as `to_dict` writes them. Answers ignore fields they
do not know (a newer service may add some).

Plain pydantic: importing this starts nothing (no FastAPI, no database).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Annotated, Any, Self

from pydantic import BaseModel, ConfigDict, Field, RootModel
from vllm_runbook.collector.agent_api import AgentState

if TYPE_CHECKING:
    from vllm_runbook.runbooks.service.discovery import Entry
    from vllm_runbook.runbooks.store import ExecutionRecord, IncidentRecord

__all__ = [
    "ApiError",
    "Decision",
    "Engine",
    "EngineState",
    "EngineStates",
    "Engines",
    "Execution",
    "Executions",
    "Incident",
    "Incidents",
    "PendingApprovals",
    "Step",
    "WhoAmI",
]

Timestamp = Annotated[str, Field(json_schema_extra={"format": "date-time"})]
"""A time as the journal writes it: ISO 8601 with its UTC offset."""


class _Answer(BaseModel):
    """What the service sends: read leniently (unknown fields ignored)."""

    model_config = ConfigDict(use_attribute_docstrings=True, frozen=True, extra="ignore")


# -- the journal --------------------------------------------------------------------


class Step(_Answer):
    """One step of an execution: an action, the knobs before and after it."""

    id: int
    ordinal: int
    """Its place in the execution (0 first)."""
    action: str
    params: dict[str, Any]
    before: dict[str, Any] | None
    """The knobs' values before the action (null: not read)."""
    after: dict[str, Any] | None
    """The knobs' values after it (null: not applied)."""
    status: str
    """planned, applying, applied, failed, skipped, interrupted or reverted."""
    error: str | None
    applied_at_step: int | None
    """The engine's scheduler step at which the change took effect."""
    started_at: Timestamp
    finished_at: Timestamp | None


class Execution(_Answer):
    """One execution of a runbook, with its steps (`ExecutionRecord.to_dict`)."""

    id: int
    runbook: str
    engine: str
    trigger: str
    """What started it: alert, cli, revert, ..."""
    who: str
    """Who asked: `rules:ALERT`, the Alertmanager receiver, a person."""
    alert_fingerprint: str | None
    alert_starts_at: Timestamp | None
    dry_run: bool
    status: str
    """pending, running, verifying, succeeded, failed, rolled_back, reverted or refused."""
    display_status: str
    """The status to show a person: `interrupted` when its process died, `nothing to
    improve` for a refusal because the condition was gone, `holding` when its alert
    resolved and its revert waits for the cause to go, `advised` for advisory mode's
    advice (a finished dry run an alert started: `reason` says what it would have
    done), else `status`."""
    interrupted: bool
    reason: str | None
    """Why it is where it is (`awaiting approval` while a person has not answered)."""
    error: str | None
    checks: dict[str, Any] | None
    """The runbook's checks before it acted."""
    verification: dict[str, Any] | None
    """The verification's judgement: signal, before, after, outcome, guards."""
    reverts_id: int | None
    """The execution this one reverts (a revert), else null."""
    hostname: str | None
    pid: int | None
    created_at: Timestamp
    started_at: Timestamp | None
    finished_at: Timestamp | None
    steps: list[Step]
    decision: str | None
    """A person's answer to an approval request: approved or rejected."""
    decided_by: str | None
    decided_at: Timestamp | None
    decision_note: str | None
    hold_since: Timestamp | None = None
    """When its alert resolved, if it held its changes after (shown `holding`)."""
    hold_note: str | None = None
    """What a holding execution waits on (the cause's signals, the hold time, a person)."""
    hold_for_person: bool = False
    """Only a person may release its revert (`runbook revert N`, the page)."""
    premature: bool = False
    """A revert whose finding came back within its watch: its fix was re-applied."""

    @classmethod
    def from_record(cls, record: ExecutionRecord) -> Self:
        return cls.model_validate(record.to_dict())


class Executions(RootModel[list[Execution]]):
    """The journal's executions, newest first (`GET /api/executions`)."""

    model_config = ConfigDict(frozen=True)

    @classmethod
    def of(cls, records: Iterable[ExecutionRecord]) -> Self:
        return cls([Execution.from_record(r) for r in records])


class PendingApprovals(RootModel[list[Execution]]):
    """The executions awaiting a person's answer, newest first, a page of at
    most 500 (`GET /api/pending?engine=&runbook=&limit=100&before=ID`; the
    answer's X-Total-Count and X-Rest-Count headers count all and the older)."""

    model_config = ConfigDict(frozen=True)

    @classmethod
    def of(cls, records: Iterable[ExecutionRecord]) -> Self:
        return cls([Execution.from_record(r) for r in records])


class Incident(_Answer):
    """An alert of the rule evaluator on one engine (`IncidentRecord.to_dict`)."""

    id: int
    alert: str
    engine: str
    severity: str
    state: str
    """pending, firing or resolved."""
    value: float | None
    """The alert expression's value when last evaluated."""
    first_seen: Timestamp
    last_seen: Timestamp
    resolved_at: Timestamp | None
    labels: dict[str, str]

    @classmethod
    def from_record(cls, record: IncidentRecord) -> Self:
        return cls.model_validate(record.to_dict())


class Incidents(RootModel[list[Incident]]):
    """Incidents recorded by the rule evaluator, newest first (`GET /api/incidents`)."""

    model_config = ConfigDict(frozen=True)

    @classmethod
    def of(cls, records: Iterable[IncidentRecord]) -> Self:
        return cls([Incident.from_record(r) for r in records])


# -- the engines --------------------------------------------------------------------


class Engine(_Answer):
    """One engine of the inventory: where it came from and when it was last seen."""

    name: str
    agent: str
    """The collector agent's base URL."""
    vllm: str | None
    """vLLM's API server base URL, when configured."""
    labels: dict[str, str]
    """How Alertmanager alerts find this engine."""
    source: str
    """`static` (the configuration) or the discovery source that found it."""
    last_seen: float
    """Unix time it was last listed by its source."""

    @classmethod
    def from_entry(cls, entry: Entry) -> Self:
        return cls.model_validate(entry.as_dict())


class Engines(RootModel[list[Engine]]):
    """The inventory: static and discovered engines (`GET /api/engines`)."""

    model_config = ConfigDict(frozen=True)


class EngineState(_Answer):
    """One engine's agent state now, or why there is none."""

    name: str
    agent: str
    up: bool
    """The agent answered with its state."""
    error: str | None
    """Why there is no state (the agent is down, or not an agent); null when up."""
    state: AgentState | None
    """The agent's /v1/state; null when down."""


class EngineStates(RootModel[list[EngineState]]):
    """Each engine's agent state now, or why not (`GET /api/engines/state`)."""

    model_config = ConfigDict(frozen=True)


# -- people -------------------------------------------------------------------------


class WhoAmI(_Answer):
    """Who the credentials answer as (`GET /api/whoami`)."""

    who: str


class Decision(_Answer):
    """An approve or reject the journal took (`POST /api/executions/{id}/approve|reject`)."""

    message: str
    execution: Execution
    """The execution after the answer."""


class ApiError(_Answer):
    """A refusal: the request was not served, or an answer was not taken."""

    error: str
    execution: Execution | None = None
    """An approve/reject too late (410) or of an execution not awaiting approval
    (409): the execution as it is."""

"""What one refresh of `runbook top` saw, and how each cell of its tables reads.

Plain data and pure functions: the sources fill a `Snapshot` (from the agents'
/v1/state or the service's API, both parsed into the models of their wire:
collector/agent_api.py, service/api.py), the app draws it with the `*_row`
functions here. Every cell is a string; a value that
is not defined now reads `–`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Final

from vllm_runbook.collector.agent_api import AgentState
from vllm_runbook.collector.metrics import TIERS
from vllm_runbook.runbooks.service.api import Execution, Incident

NONE: Final = "–"
AWAITING: Final = "awaiting approval"  # ApprovalState.AWAITING, as the API shows it
ACTIVE: Final = ("pending", "running", "verifying")  # ExecutionStatus values not yet finished

ENGINE_COLUMNS: Final = (
    "ENGINE",
    "KV USE",
    "KV HIT",
    "FRAG",
    "RUN",
    "WAIT h/w/c",
    "OLDEST h/w/c",
    "PREEMPT/MIN",
    "P99",
    "BUDGET",
    "SEQS",
    "POLICY",
    "AUTOPILOT",
)
FINDING_COLUMNS: Final = ("ALERT", "SEVERITY", "ENGINE", "VALUE", "SEEN FOR")
EXECUTION_COLUMNS: Final = ("ID", "RUNBOOK", "ENGINE", "STATUS", "BY", "AGE")


@dataclass(frozen=True)
class EngineView:
    """One engine as the refresh saw it: its state, or why there is none."""

    name: str
    state: AgentState | None
    error: str | None = None

    @property
    def up(self) -> bool:
        return self.state is not None


@dataclass(frozen=True)
class Finding:
    """A firing alert of the rules (the embedded evaluator's, or the service's incidents)."""

    alert: str
    severity: str
    engine: str
    value: float | None
    since: float  # unix time it started firing (or was first seen)


@dataclass(frozen=True)
class ExecutionView:
    id: int
    runbook: str
    engine: str
    status: str  # display status, or "awaiting approval"
    who: str
    created: float  # unix time

    @property
    def awaiting(self) -> bool:
        return self.status == AWAITING


@dataclass(frozen=True)
class Snapshot:
    """Everything one refresh read. `executions` None: no journal to read
    (`--engine` without `--db`/`--config`); `problems`: one line each, what
    could not be read this time (the rest is still shown)."""

    taken_at: float
    engines: tuple[EngineView, ...]
    findings: tuple[Finding, ...]
    executions: tuple[ExecutionView, ...] | None
    problems: tuple[str, ...] = field(default=())


# -- cells ------------------------------------------------------------------------


def pct(value: float | None) -> str:
    """A ratio as a percentage with one decimal: 0.4567 → `45.7%`."""
    if value is None or math.isnan(value):
        return NONE
    return f"{100 * value:.1f}%"


def seconds(value: float | None) -> str:
    """A duration the way a person reads it: `850ms`, `4.2s`, `42s`, `3m05s`, `2h07m`."""
    if value is None or math.isnan(value) or value < 0:
        return NONE
    if value < 1:
        return f"{value * 1000:.0f}ms"
    if value < 10:
        return f"{value:.1f}s"
    if value < 60:
        return f"{value:.0f}s"
    whole = int(value)
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def knob(now: int, startup: int) -> str:
    """An effective value and, when it was changed at runtime, its startup value."""
    return str(now) if now == startup else f"{now}/{startup}*"


def autopilot(state: AgentState) -> str:
    pilot = state.autopilot
    if pilot.enabled:
        limit = f" seqs {pilot.limit}" if pilot.limit is not None else ""
        return f"on {pilot.target:.2f}{limit}"
    return "off (error)" if pilot.error else "off"


def per_tier(state: AgentState) -> tuple[str, str]:
    """Waiting requests and the oldest wait, per tier (hot/warm/cold); while the
    scheduler lock was busy the agent has no per-tier view: the totals then."""
    now = state.tiers.now
    if now is None:
        stats = state.stats
        longest = stats.oldest_waiting if stats.requests_waiting else None
        return f"{stats.requests_waiting} all", seconds(longest)
    waiting = "/".join(str(now[t].waiting) if t in now else NONE for t in TIERS)
    oldest = "/".join(
        seconds(now[t].oldest_waiting_seconds) if t in now and now[t].waiting else NONE
        for t in TIERS
    )
    return waiting, oldest


def engine_row(view: EngineView) -> tuple[str, ...]:
    """One row of the engines table (ENGINE_COLUMNS)."""
    state = view.state
    if state is None:
        return (view.name, "DOWN", *([NONE] * (len(ENGINE_COLUMNS) - 2)))
    stats, knobs, startup = state.stats, state.knobs, state.startup
    waiting, oldest = per_tier(state)
    usage = pct(stats.kv_cache_usage)
    return (
        view.name if state.collector_up else f"{view.name} (collector off)",
        usage,
        pct(stats.kv_hit_ratio),
        pct(stats.block_fragmentation),
        str(stats.requests_running),
        waiting,
        oldest,
        f"{stats.preemptions_per_minute:.1f}",
        seconds(stats.engine_e2e_latency_p99),
        knob(knobs.max_num_batched_tokens, startup.max_num_batched_tokens),
        knob(knobs.max_num_seqs, startup.max_num_seqs),
        knobs.policy if knobs.policy == startup.policy else f"{knobs.policy}*",
        autopilot(state),
    )


def finding_row(finding: Finding, now: float) -> tuple[str, ...]:
    value = NONE if finding.value is None else f"{finding.value:.4g}"
    return (
        finding.alert,
        finding.severity,
        finding.engine,
        value,
        seconds(max(0.0, now - finding.since)),
    )


def execution_row(execution: ExecutionView, now: float) -> tuple[str, ...]:
    return (
        str(execution.id),
        execution.runbook,
        execution.engine,
        execution.status,
        execution.who,
        seconds(max(0.0, now - execution.created)),
    )


# -- from the API's models ---------------------------------------------------------


def _unix(text: str | None) -> float:
    if not text:
        return math.nan
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def finding_from_incident(incident: Incident) -> Finding:
    """A firing incident as /api/incidents answers it."""
    return Finding(
        alert=incident.alert,
        severity=incident.severity,
        engine=incident.engine,
        value=incident.value,
        since=_unix(incident.first_seen),
    )


def executions_from(
    recent: Sequence[Execution], pending: Sequence[Execution]
) -> tuple[ExecutionView, ...]:
    """What is in progress (pending, running, verifying) and what awaits a person,
    from /api/executions and /api/pending (or the journal's records as those
    answer them), oldest first."""
    awaiting = {e.id for e in pending}
    rows: dict[int, ExecutionView] = {}
    for execution in [*recent, *pending]:
        status = execution.display_status or execution.status
        if execution.id in awaiting:
            status = AWAITING
        elif status not in ACTIVE:
            continue
        rows[execution.id] = ExecutionView(
            id=execution.id,
            runbook=execution.runbook,
            engine=execution.engine,
            status=status,
            who=execution.who,
            created=_unix(execution.created_at),
        )
    return tuple(rows[i] for i in sorted(rows))

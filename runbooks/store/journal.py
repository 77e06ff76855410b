"""The runbook journal: executions, their steps, the service's leases, and incidents.

Every call is its own transaction and commits before it returns. That is the
crash-safety contract the executor builds on: it records a step as
`applying` with the knob values *before* acting, and as `applied` with the
values after, so a SIGKILL at any instant leaves a journal that says what may
have changed and what to restore.

Everything handed out is an immutable record (`ExecutionRecord`,
`StepRecord`), never a live ORM object: callers cannot lazy-load after the
session closed, and the records serialise to stable JSON.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Final

from sqlalchemy import Engine, case, delete, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, selectinload, sessionmaker
from vllm_runbook.runbooks.store.database import (
    WRITE_OPTION,
    display_url,
    make_engine,
    resolve_url,
    translated_errors,
)
from vllm_runbook.runbooks.store.errors import ExecutionNotFound, IllegalTransition, StoreError
from vllm_runbook.runbooks.store.models import (
    ACTIVE_STATUSES,
    EXECUTION_STATUSES,
    EXECUTION_TRANSITIONS,
    FINAL_STATUSES,
    INCIDENT_STATES,
    INTERRUPTED_REASON,
    REFUSED,
    RUNNING,
    STEP_APPLIED,
    STEP_APPLYING,
    STEP_FAILED,
    STEP_INTERRUPTED,
    STEP_PLANNED,
    STEP_REVERTED,
    STEP_SKIPPED,
    STEP_STATUSES,
    TRIGGER_SOURCES,
    Execution,
    Incident,
    Lease,
    Step,
    episode_key,
    incident_open_key,
    utcnow,
)

# What add_step may start a step as, and what finish_step may end it as.
_STEP_START_STATUSES: Final = frozenset({STEP_APPLYING, STEP_PLANNED, STEP_SKIPPED})
_STEP_FINISH_STATUSES: Final = {
    STEP_APPLYING: frozenset({STEP_APPLIED, STEP_FAILED}),
    STEP_APPLIED: frozenset({STEP_REVERTED}),
    STEP_INTERRUPTED: frozenset({STEP_REVERTED}),
}


# --- process identity ------------------------------------------------------------


def _proc_start_ticks(pid: int) -> int | None:
    """Start time of a process in clock ticks since boot (Linux), else None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    # The command name may hold spaces and parentheses: split after the last ')'.
    fields = stat[stat.rfind(")") + 2 :].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def _proc_is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return False
    return stat[stat.rfind(")") + 2 :][:1] == "Z"


def process_alive(pid: int, pid_start: int | None) -> bool:
    """Whether the process that wrote a row is still running on this host.

    A zombie is dead (it runs nothing), and a live pid with another start time
    is a different process that reused the number.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    if _proc_is_zombie(pid):
        return False
    if pid_start is not None:
        current = _proc_start_ticks(pid)
        if current is not None and current != pid_start:
            return False
    return True


_HOSTNAME: Final = socket.gethostname()


# --- records ---------------------------------------------------------------------


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


@dataclass(frozen=True, slots=True)
class StepRecord:
    id: int
    execution_id: int
    ordinal: int
    action: str
    params: dict[str, Any]
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    status: str
    error: str | None
    applied_at_step: int | None
    started_at: datetime
    finished_at: datetime | None

    @classmethod
    def from_row(cls, row: Step) -> StepRecord:
        return cls(
            id=row.id,
            execution_id=row.execution_id,
            ordinal=row.ordinal,
            action=row.action,
            params=dict(row.params or {}),
            before=row.before,
            after=row.after,
            status=row.status,
            error=row.error,
            applied_at_step=row.applied_at_step,
            started_at=row.started_at,
            finished_at=row.finished_at,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "ordinal": self.ordinal,
            "action": self.action,
            "params": self.params,
            "before": self.before,
            "after": self.after,
            "status": self.status,
            "error": self.error,
            "applied_at_step": self.applied_at_step,
            "started_at": _iso(self.started_at),
            "finished_at": _iso(self.finished_at),
        }


@dataclass(frozen=True, slots=True)
class ExecutionRecord:
    id: int
    runbook: str
    engine: str
    trigger: str
    who: str
    alert_fingerprint: str | None
    alert_starts_at: datetime | None
    dry_run: bool
    status: str
    reason: str | None
    error: str | None
    checks: dict[str, Any] | None
    verification: dict[str, Any] | None
    reverts_id: int | None
    hostname: str | None
    pid: int | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    # True when the row says active but its process is gone (judged on the
    # host that ran it only): the journal's honest answer after a crash.
    interrupted: bool = False
    steps: tuple[StepRecord, ...] = field(default=())

    @classmethod
    def from_row(cls, row: Execution, *, with_steps: bool = True) -> ExecutionRecord:
        interrupted = (
            row.status in ACTIVE_STATUSES
            and row.hostname == _HOSTNAME
            and row.pid is not None
            and not process_alive(row.pid, row.pid_start)
        )
        return cls(
            id=row.id,
            runbook=row.runbook,
            engine=row.engine,
            trigger=row.trigger,
            who=row.who,
            alert_fingerprint=row.alert_fingerprint,
            alert_starts_at=row.alert_starts_at,
            dry_run=row.dry_run,
            status=row.status,
            reason=row.reason,
            error=row.error,
            checks=row.checks,
            verification=row.verification,
            reverts_id=row.reverts_id,
            hostname=row.hostname,
            pid=row.pid,
            created_at=row.created_at,
            started_at=row.started_at,
            finished_at=row.finished_at,
            interrupted=interrupted,
            steps=tuple(StepRecord.from_row(s) for s in row.steps) if with_steps else (),
        )

    @property
    def display_status(self) -> str:
        """The status to show a person: 'interrupted' when the run died."""
        return INTERRUPTED_REASON if self.interrupted else self.status

    def to_dict(self) -> dict[str, Any]:
        """Stable JSON shape for `--json` and the service's API."""
        return {
            "id": self.id,
            "runbook": self.runbook,
            "engine": self.engine,
            "trigger": self.trigger,
            "who": self.who,
            "alert_fingerprint": self.alert_fingerprint,
            "alert_starts_at": _iso(self.alert_starts_at),
            "dry_run": self.dry_run,
            "status": self.status,
            "display_status": self.display_status,
            "interrupted": self.interrupted,
            "reason": self.reason,
            "error": self.error,
            "checks": self.checks,
            "verification": self.verification,
            "reverts_id": self.reverts_id,
            "hostname": self.hostname,
            "pid": self.pid,
            "created_at": _iso(self.created_at),
            "started_at": _iso(self.started_at),
            "finished_at": _iso(self.finished_at),
            "steps": [s.to_dict() for s in self.steps],
        }


# --- the store -------------------------------------------------------------------


class Store:
    """Durable journal of runbook executions (SQLite file or PostgreSQL)."""

    def __init__(self, url: str | None = None, *, engine: Engine | None = None) -> None:
        self.url = resolve_url(url)
        self.engine = engine if engine is not None else make_engine(self.url)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._write_sessions = sessionmaker(
            self.engine.execution_options(**{WRITE_OPTION: True}), expire_on_commit=False
        )

    def __repr__(self) -> str:
        return f"Store({display_url(self.url)!r})"

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def close(self) -> None:
        self.engine.dispose()

    @contextmanager
    def session(self, *, write: bool = False) -> Iterator[Session]:
        """A transaction: commits on success, rolls back on error.

        `write=True` takes SQLite's write lock at BEGIN so concurrent writers
        wait on the busy timeout rather than failing mid-transaction.
        """
        factory = self._write_sessions if write else self._sessions
        with translated_errors(self.url), factory() as session, session.begin():
            yield session

    def _insert(self) -> Any:
        # ON CONFLICT DO NOTHING exists in both dialects we support; it makes
        # the duplicate-webhook path one statement with no exception to catch.
        if self.dialect == "postgresql":
            return postgresql.insert
        if self.dialect == "sqlite":
            return sqlite.insert
        raise StoreError(f"unsupported database dialect {self.dialect!r}")

    # --- executions --------------------------------------------------------------

    def create_execution(
        self,
        runbook: str,
        engine: str,
        *,
        trigger: str,
        who: str,
        dry_run: bool = False,
        alert_fingerprint: str | None = None,
        alert_starts_at: datetime | None = None,
        reason: str | None = None,
        reverts_id: int | None = None,
    ) -> tuple[ExecutionRecord, bool]:
        """Record a new pending execution; returns (record, created).

        For trigger 'alert' the (runbook, engine, fingerprint, startsAt)
        episode is unique: a duplicate delivery returns the existing execution
        with created=False, race-free across processes and replicas.
        """
        if trigger not in TRIGGER_SOURCES:
            raise ValueError(f"trigger {trigger!r} not in {TRIGGER_SOURCES}")
        key: str | None = None
        if trigger == "alert":
            if not alert_fingerprint or alert_starts_at is None:
                raise ValueError("an alert-triggered execution needs a fingerprint and startsAt")
            # One execution per episode (the evaluator's incidents are recorded
            # as alert episodes too); the schema checks key <=> trigger 'alert'.
            key = episode_key(runbook, engine, alert_fingerprint, alert_starts_at)
        now = utcnow()
        values = {
            "runbook": runbook,
            "engine": engine,
            "trigger": trigger,
            "who": who,
            "dry_run": dry_run,
            "alert_fingerprint": alert_fingerprint,
            "alert_starts_at": alert_starts_at,
            "episode_key": key,
            "status": "pending",
            "reason": reason,
            "reverts_id": reverts_id,
            "hostname": _HOSTNAME,
            "pid": os.getpid(),
            "pid_start": _proc_start_ticks(os.getpid()),
            "created_at": now,
            "updated_at": now,
        }
        with self.session(write=True) as s:
            if key is None:
                row = Execution(**values)
                s.add(row)
                s.flush()
                return ExecutionRecord.from_row(row), True
            stmt = (
                self._insert()(Execution)
                .values(**values)
                .on_conflict_do_nothing(index_elements=["episode_key"])
                .returning(Execution.id)
            )
            new_id = s.execute(stmt).scalar_one_or_none()
            created = new_id is not None
            found = s.scalars(
                select(Execution)
                .where(Execution.episode_key == key)
                .options(selectinload(Execution.steps))
            ).one()
            return ExecutionRecord.from_row(found), created

    def transition(
        self,
        execution_id: int,
        new_status: str,
        error: str | None = None,
        *,
        reason: str | None = None,
    ) -> ExecutionRecord:
        """Move an execution along its state machine; illegal moves raise.

        Entering 'running' stamps the current process as the runner (so a
        crash can be recognised later); a final status stamps finished_at.
        """
        if new_status not in EXECUTION_STATUSES:
            raise ValueError(f"status {new_status!r} not in {EXECUTION_STATUSES}")
        with self.session(write=True) as s:
            row = self._get_locked(s, execution_id)
            if new_status not in EXECUTION_TRANSITIONS[row.status]:
                raise IllegalTransition(execution_id, row.status, new_status)
            now = utcnow()
            row.status = new_status
            if new_status == RUNNING:
                row.started_at = now
                row.hostname, row.pid = _HOSTNAME, os.getpid()
                row.pid_start = _proc_start_ticks(row.pid)
            if new_status in FINAL_STATUSES and row.finished_at is None:
                row.finished_at = now
            if error is not None:
                row.error = error
            if reason is not None:
                row.reason = reason
            s.flush()
            return ExecutionRecord.from_row(row)

    def record_checks(self, execution_id: int, checks: dict[str, Any]) -> None:
        """Store the diagnostics gathered before acting (shown in reports)."""
        with self.session(write=True) as s:
            self._get_locked(s, execution_id).checks = checks

    def record_verification(self, execution_id: int, verification: dict[str, Any]) -> None:
        """Store the verification outcome (signal before/after, deadline, verdict)."""
        with self.session(write=True) as s:
            self._get_locked(s, execution_id).verification = verification

    def _get_locked(self, s: Session, execution_id: int) -> Execution:
        row = s.get(Execution, execution_id, with_for_update=True)
        if row is None:
            raise ExecutionNotFound(execution_id)
        return row

    def get_execution(self, execution_id: int) -> ExecutionRecord:
        with self.session() as s:
            row = s.get(Execution, execution_id, options=[selectinload(Execution.steps)])
            if row is None:
                raise ExecutionNotFound(execution_id)
            return ExecutionRecord.from_row(row)

    def list_executions(
        self, engine: str | None = None, *, runbook: str | None = None, limit: int = 50
    ) -> list[ExecutionRecord]:
        """Newest first, with their steps."""
        query = select(Execution).options(selectinload(Execution.steps))
        if engine is not None:
            query = query.where(Execution.engine == engine)
        if runbook is not None:
            query = query.where(Execution.runbook == runbook)
        query = query.order_by(Execution.id.desc()).limit(limit)
        with self.session() as s:
            return [ExecutionRecord.from_row(r) for r in s.scalars(query)]

    def _real_runs(self, runbook: str, engine: str) -> Any:
        # What counts for cooldown and rate limits: runs that started for real.
        # Dry runs changed nothing; refusals never ran.
        return select(Execution).where(
            Execution.runbook == runbook,
            Execution.engine == engine,
            Execution.dry_run.is_(False),
            Execution.status != REFUSED,
            Execution.started_at.is_not(None),
        )

    def last_execution(self, runbook: str, engine: str) -> ExecutionRecord | None:
        """The latest real run of a runbook on an engine (for the cooldown)."""
        query = (
            self._real_runs(runbook, engine)
            .options(selectinload(Execution.steps))
            .order_by(Execution.started_at.desc(), Execution.id.desc())
            .limit(1)
        )
        with self.session() as s:
            row = s.scalars(query).first()
            return None if row is None else ExecutionRecord.from_row(row)

    def count_runs_since(self, runbook: str, engine: str, since: datetime) -> int:
        """Real runs started at or after `since` (for max runs per hour)."""
        if since.tzinfo is None:
            raise ValueError("since must be timezone-aware")
        query = self._real_runs(runbook, engine).where(Execution.started_at >= since)
        with self.session() as s:
            return s.scalar(select(func.count()).select_from(query.subquery())) or 0

    def engines_under_remediation(self) -> set[str]:
        """Engines with a real execution pending, running or verifying."""
        query = (
            select(Execution.engine)
            .where(Execution.status.in_(ACTIVE_STATUSES), Execution.dry_run.is_(False))
            .distinct()
        )
        with self.session() as s:
            return set(s.scalars(query))

    def recover_interrupted(self) -> list[int]:
        """Mark active executions whose process died on this host as failed.

        Steps left 'applying' become 'interrupted' (their effect is unknown;
        their before-values still allow a revert). Executions run from other
        hosts are left alone: their liveness cannot be judged from here.
        Returns the ids marked.
        """
        query = select(Execution.id, Execution.pid, Execution.pid_start).where(
            Execution.status.in_(ACTIVE_STATUSES), Execution.hostname == _HOSTNAME
        )
        with self.session() as s:
            candidates = [
                row.id
                for row in s.execute(query)
                if row.pid is not None and not process_alive(row.pid, row.pid_start)
            ]
        recovered: list[int] = []
        for execution_id in candidates:
            with self.session(write=True) as s:
                row = self._get_locked(s, execution_id)
                # Re-check under the lock: another process may have got there.
                if row.status not in ACTIVE_STATUSES:
                    continue
                now = utcnow()
                row.status, row.error, row.finished_at = "failed", INTERRUPTED_REASON, now
                s.execute(
                    update(Step)
                    .where(Step.execution_id == execution_id, Step.status == STEP_APPLYING)
                    .values(
                        status=STEP_INTERRUPTED,
                        error="process died while applying; effect unknown",
                        finished_at=now,
                    )
                )
                recovered.append(execution_id)
        return recovered

    # --- steps -------------------------------------------------------------------

    def add_step(
        self,
        execution_id: int,
        action: str,
        params: dict[str, Any] | None = None,
        *,
        before: dict[str, Any] | None = None,
        after: dict[str, Any] | None = None,
        status: str = STEP_APPLYING,
        error: str | None = None,
    ) -> StepRecord:
        """Record a step, committed before the caller acts.

        Call with status 'applying' and the before-values *before* running the
        action: if the process dies during it, the journal still holds what
        to restore. 'planned' (dry-run) and 'skipped' steps are final at once.
        """
        if status not in _STEP_START_STATUSES:
            raise ValueError(f"a step starts as one of {sorted(_STEP_START_STATUSES)}")
        with self.session(write=True) as s:
            execution = self._get_locked(s, execution_id)
            if execution.status not in ACTIVE_STATUSES:
                raise StoreError(f"execution {execution_id} is {execution.status}: no more steps")
            last = s.scalar(select(func.max(Step.ordinal)).where(Step.execution_id == execution_id))
            now = utcnow()
            row = Step(
                execution_id=execution_id,
                ordinal=(last or 0) + 1,
                action=action,
                params=params or {},
                before=before,
                after=after,
                status=status,
                error=error,
                started_at=now,
                finished_at=None if status == STEP_APPLYING else now,
            )
            s.add(row)
            s.flush()
            return StepRecord.from_row(row)

    def finish_step(
        self,
        step_id: int,
        status: str,
        *,
        after: dict[str, Any] | None = None,
        error: str | None = None,
        applied_at_step: int | None = None,
    ) -> StepRecord:
        """Close a step: applying → applied | failed, or applied → reverted."""
        if status not in STEP_STATUSES:
            raise ValueError(f"step status {status!r} not in {STEP_STATUSES}")
        with self.session(write=True) as s:
            row = s.get(Step, step_id, with_for_update=True)
            if row is None:
                raise StoreError(f"no step with id {step_id}")
            if status not in _STEP_FINISH_STATUSES.get(row.status, frozenset()):
                raise StoreError(f"step {step_id}: cannot go from {row.status!r} to {status!r}")
            row.status = status
            row.finished_at = utcnow()
            if after is not None:
                row.after = after
            if error is not None:
                row.error = error
            if applied_at_step is not None:
                row.applied_at_step = applied_at_step
            s.flush()
            return StepRecord.from_row(row)

    # --- leases ------------------------------------------------------------------

    def acquire_lease(self, name: str, holder: str, ttl_seconds: float) -> bool:
        """Take or extend the named lease; False while another holder's is live.

        Uses this host's clock: replicas are assumed NTP-synchronised to well
        under the TTL.
        """
        now = utcnow()
        expires = now + timedelta(seconds=ttl_seconds)
        with self.session(write=True) as s:
            taken = s.execute(
                update(Lease)
                .where(Lease.name == name, (Lease.holder == holder) | (Lease.expires_at <= now))
                .values(holder=holder, expires_at=expires)
                .execution_options(synchronize_session=False)
            )
            if taken.rowcount == 1:  # type: ignore[attr-defined]
                return True
            inserted = s.execute(
                self._insert()(Lease)
                .values(name=name, holder=holder, expires_at=expires)
                .on_conflict_do_nothing(index_elements=["name"])
                .returning(Lease.name)
            ).scalar_one_or_none()
            return inserted is not None

    def renew_lease(self, name: str, holder: str, ttl_seconds: float) -> bool:
        """Extend a lease this holder still holds; False if it lapsed or was taken."""
        now = utcnow()
        with self.session(write=True) as s:
            renewed = s.execute(
                update(Lease)
                .where(Lease.name == name, Lease.holder == holder, Lease.expires_at > now)
                .values(expires_at=now + timedelta(seconds=ttl_seconds))
                .execution_options(synchronize_session=False)
            )
            return renewed.rowcount == 1  # type: ignore[attr-defined]

    def release_lease(self, name: str, holder: str) -> bool:
        """Give a lease up early so another replica need not wait for the TTL."""
        with self.session(write=True) as s:
            released = s.execute(
                update(Lease)
                .where(Lease.name == name, Lease.holder == holder)
                .values(expires_at=utcnow())
                .execution_options(synchronize_session=False)
            )
            return released.rowcount == 1  # type: ignore[attr-defined]

    def lease_holder(self, name: str) -> str | None:
        """The current holder of a live lease, or None."""
        with self.session() as s:
            return s.scalar(
                select(Lease.holder).where(Lease.name == name, Lease.expires_at > utcnow())
            )

    # --- incidents (written by the rules engine's SQL sink) ------------------------

    def record_incident(
        self,
        alert: str,
        engine: str,
        *,
        state: str,
        severity: str,
        value: float | None,
        first_seen: datetime,
        last_seen: datetime,
        labels: dict[str, str] | None = None,
        resolved_at: datetime | None = None,
    ) -> IncidentRecord | None:
        """Open, update or resolve the one open incident of (alert, engine).

        pending / firing: updates the open incident (its first_seen stays) or
        opens one, in one statement keyed on the open_key unique constraint,
        so two writers cannot open two; a firing incident is never set back
        to pending. resolved: closes the open incident
        (resolved_at defaults to last_seen); None when none was open.
        """
        if state not in INCIDENT_STATES:
            raise ValueError(f"incident state {state!r} not in {INCIDENT_STATES}")
        if state == "resolved":
            return self._resolve_incident(alert, engine, value, last_seen, resolved_at or last_seen)
        values = {
            "alert": alert,
            "engine": engine,
            "severity": severity,
            "state": state,
            "value": _finite(value),
            "first_seen": first_seen,
            "last_seen": last_seen,
            "labels": dict(labels or {}),
            "open_key": incident_open_key(alert, engine),
        }
        insert = self._insert()(Incident).values(**values)
        refreshed = {k: insert.excluded[k] for k in ("severity", "value", "last_seen", "labels")}
        # Once fired, an incident stays firing until resolved (a restarted
        # evaluator re-detects it as pending first).
        refreshed["state"] = case(
            (Incident.state == "firing", "firing"), else_=insert.excluded.state
        )
        stmt = insert.on_conflict_do_update(index_elements=["open_key"], set_=refreshed).returning(
            Incident
        )
        with self.session(write=True) as s:
            return IncidentRecord.from_row(s.scalars(stmt).one())

    def _resolve_incident(
        self, alert: str, engine: str, value: float | None, last_seen: datetime, at: datetime
    ) -> IncidentRecord | None:
        with self.session(write=True) as s:
            row = s.scalars(
                select(Incident)
                .where(Incident.open_key == incident_open_key(alert, engine))
                .with_for_update()
            ).first()
            if row is None:
                return None
            row.state, row.resolved_at = "resolved", at
            row.last_seen = max(row.last_seen, last_seen)
            if value is not None:
                row.value = _finite(value)
            s.flush()
            return IncidentRecord.from_row(row)

    def discard_pending_incident(self, alert: str, engine: str) -> bool:
        """Forget an open incident that never fired (its condition cleared within `for`)."""
        with self.session(write=True) as s:
            gone = s.execute(
                delete(Incident).where(
                    Incident.open_key == incident_open_key(alert, engine),
                    Incident.state == "pending",
                )
            )
            return gone.rowcount == 1  # type: ignore[attr-defined]

    def touch_incidents(self, seen: Sequence[tuple[str, str, float | None, datetime]]) -> int:
        """Refresh last_seen and value of open incidents: (alert, engine, value, last_seen)."""
        count = 0
        with self.session(write=True) as s:
            for alert, engine, value, last_seen in seen:
                done = s.execute(
                    update(Incident)
                    .where(Incident.open_key == incident_open_key(alert, engine))
                    .values(value=_finite(value), last_seen=last_seen)
                    .execution_options(synchronize_session=False)
                )
                count += done.rowcount  # type: ignore[attr-defined]
        return count

    def resolve_stale_incidents(
        self, last_seen_before: datetime, *, at: datetime
    ) -> list[IncidentRecord]:
        """Resolve open incidents nobody saw since `last_seen_before`.

        After a restart the evaluator has forgotten what was open; an
        incident whose condition cleared meanwhile is closed here instead of
        staying open forever. Pending ones that never fired are discarded.
        """
        if last_seen_before.tzinfo is None or at.tzinfo is None:
            raise ValueError("times must be timezone-aware")
        stale = Incident.open_key.is_not(None), Incident.last_seen < last_seen_before
        with self.session(write=True) as s:
            s.execute(delete(Incident).where(*stale, Incident.state == "pending"))
            rows = list(s.scalars(select(Incident).where(*stale).with_for_update()))
            for row in rows:
                row.state, row.resolved_at = "resolved", at
            s.flush()
            return [IncidentRecord.from_row(r) for r in rows]

    def list_incidents(
        self,
        *,
        open_only: bool = False,
        engine: str | None = None,
        alert: str | None = None,
        limit: int = 100,
    ) -> list[IncidentRecord]:
        """Newest first (by first_seen, then id)."""
        query = select(Incident)
        if open_only:
            query = query.where(Incident.open_key.is_not(None))
        if engine is not None:
            query = query.where(Incident.engine == engine)
        if alert is not None:
            query = query.where(Incident.alert == alert)
        query = query.order_by(Incident.first_seen.desc(), Incident.id.desc()).limit(limit)
        with self.session() as s:
            return [IncidentRecord.from_row(r) for r in s.scalars(query)]


def _finite(value: float | None) -> float | None:
    # NaN and ±Inf are not portable through JSON and some drivers: store NULL.
    return value if value is not None and math.isfinite(value) else None


@dataclass(frozen=True, slots=True)
class IncidentRecord:
    id: int
    alert: str
    engine: str
    severity: str
    state: str
    value: float | None
    first_seen: datetime
    last_seen: datetime
    resolved_at: datetime | None
    labels: dict[str, str]

    @property
    def open(self) -> bool:
        return self.state != "resolved"

    @classmethod
    def from_row(cls, row: Incident) -> IncidentRecord:
        return cls(
            id=row.id,
            alert=row.alert,
            engine=row.engine,
            severity=row.severity,
            state=row.state,
            value=row.value,
            first_seen=row.first_seen,
            last_seen=row.last_seen,
            resolved_at=row.resolved_at,
            labels=dict(row.labels or {}),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "alert": self.alert,
            "engine": self.engine,
            "severity": self.severity,
            "state": self.state,
            "value": self.value,
            "first_seen": _iso(self.first_seen),
            "last_seen": _iso(self.last_seen),
            "resolved_at": _iso(self.resolved_at),
            "labels": self.labels,
        }

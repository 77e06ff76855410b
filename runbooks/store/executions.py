"""The journal of runbook executions and their steps.

Every call is its own transaction and commits before it returns. That is the
crash-safety contract the executor builds on: it records a step as
`applying` with the knob values *before* acting, and as `applied` with the
values after, so a SIGKILL at any instant leaves a journal that says what may
have changed and what to restore.

Everything handed out is an immutable record (`ExecutionRecord`,
`StepRecord`), never a live ORM object: callers cannot lazy-load after the
session closed, and the records serialise to stable JSON.

The guardrail queries (cooldown, runs per hour, blast radius) are here too:
the executor asks them, under its admission lease, before it acts.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final, cast

from sqlalchemy import Select, Table, func, insert, select, text, update
from sqlalchemy.orm import Session, selectinload
from vllm_runbook.runbooks.store.base import StoreBase, iso
from vllm_runbook.runbooks.store.errors import ExecutionNotFound, IllegalTransition, StoreError
from vllm_runbook.runbooks.store.events import touch_executions
from vllm_runbook.runbooks.store.liveness import HOSTNAME, process_alive, process_start
from vllm_runbook.runbooks.store.models import (
    ACTIVE_STATUSES,
    ADVISED,
    EXECUTION_STATUSES,
    EXECUTION_TRANSITIONS,
    FINAL_STATUSES,
    HOLDABLE_STATUSES,
    HOLDING,
    INTERRUPTED_REASON,
    NOTHING_TO_IMPROVE,
    RUNNABLE_SQL,
    STEP_APPLIED,
    STEP_APPLYING,
    STEP_FAILED,
    STEP_INTERRUPTED,
    STEP_PLANNED,
    STEP_REVERTED,
    STEP_SKIPPED,
    STEP_STATUSES,
    TRIGGER_SOURCES,
    ApprovalState,
    Execution,
    ExecutionStatus,
    Step,
    episode_key,
    is_advised,
    is_nothing_to_improve,
    is_row_id,
    utcnow,
)

# What add_step may start a step as, and what finish_step may end it as.
_STEP_START_STATUSES: Final = frozenset({STEP_APPLYING, STEP_PLANNED, STEP_SKIPPED})
_STEP_FINISH_STATUSES: Final = {
    STEP_APPLYING: frozenset({STEP_APPLIED, STEP_FAILED}),
    STEP_APPLIED: frozenset({STEP_REVERTED}),
    STEP_INTERRUPTED: frozenset({STEP_REVERTED}),
}


def runnable_ids_sql(dialect: str) -> str:
    """The worker's query (bind `after`, `limit`). SQLite without statistics
    prefers ix_executions_status (every pending row, those awaiting a person
    included): name the partial index. PostgreSQL picks it from its statistics."""
    index = " INDEXED BY ix_executions_runnable" if dialect == "sqlite" else ""
    return (
        f"SELECT id FROM executions{index} WHERE {RUNNABLE_SQL} AND id > :after "
        "ORDER BY id LIMIT :limit"
    )


def runs_in_its_process(status: str, trigger: str) -> bool:
    """Whether the process a row names (hostname, pid) is the one running it,
    so that its death interrupts the execution: a run under way, or a CLI
    execution not started yet (`runbook exec` records it, then runs it). A
    pending alert execution names the replica that received the webhook; any
    worker runs it, and that replica dying interrupts nothing."""
    return status in (ExecutionStatus.RUNNING, ExecutionStatus.VERIFYING) or (
        status == ExecutionStatus.PENDING and trigger == "cli"
    )


# --- records ---------------------------------------------------------------------


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
            "started_at": iso(self.started_at),
            "finished_at": iso(self.finished_at),
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
    # A person's answer to an approval request: 'approved' | 'rejected'.
    decision: str | None = None
    decided_by: str | None = None
    decided_at: datetime | None = None
    decision_note: str | None = None
    updated_at: datetime | None = None
    # The revert's hold (status 'holding'): since the alert resolved, what it
    # waits on, and whether only a person may release it.
    hold_since: datetime | None = None
    hold_note: str | None = None
    hold_for_person: bool = False
    # A revert whose finding came back inside its watch (it was re-applied).
    premature: bool = False

    @classmethod
    def from_row(cls, row: Execution, *, with_steps: bool = True) -> ExecutionRecord:
        interrupted = (
            runs_in_its_process(row.status, row.trigger)
            and row.hostname == HOSTNAME
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
            decision=row.decision,
            decided_by=row.decided_by,
            decided_at=row.decided_at,
            decision_note=row.decision_note,
            updated_at=row.updated_at,
            hold_since=row.hold_since,
            hold_note=row.hold_note,
            hold_for_person=bool(row.hold_for_person),
            premature=bool(row.premature),
        )

    @property
    def awaiting_approval(self) -> bool:
        """Pending until a person approves or rejects it."""
        return (
            self.status == ExecutionStatus.PENDING
            and self.reason == ApprovalState.AWAITING
            and not self.decision
        )

    @property
    def holding(self) -> bool:
        """Its alert resolved; its changes stay until the cause is gone (or a person)."""
        return self.hold_since is not None and self.status in HOLDABLE_STATUSES and not self.advised

    @property
    def display_status(self) -> str:
        """The status to show a person: 'interrupted' when the run died, 'nothing to
        improve' for a refusal because the condition was gone."""
        if is_nothing_to_improve(self.status, self.reason):
            return NOTHING_TO_IMPROVE
        if self.holding:
            return HOLDING
        if self.advised and self.status == ExecutionStatus.SUCCEEDED:
            return ADVISED
        return INTERRUPTED_REASON if self.interrupted else self.status

    @property
    def advised(self) -> bool:
        """Advisory mode's advice: an alert's dry run (runbooks/run/advisory.py)."""
        return is_advised(self.dry_run, self.trigger)

    def to_dict(self) -> dict[str, Any]:
        """Stable JSON shape for `--json` and the service's API."""
        return {
            "id": self.id,
            "runbook": self.runbook,
            "engine": self.engine,
            "trigger": self.trigger,
            "who": self.who,
            "alert_fingerprint": self.alert_fingerprint,
            "alert_starts_at": iso(self.alert_starts_at),
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
            "created_at": iso(self.created_at),
            "started_at": iso(self.started_at),
            "finished_at": iso(self.finished_at),
            "steps": [s.to_dict() for s in self.steps],
            "decision": self.decision,
            "decided_by": self.decided_by,
            "decided_at": iso(self.decided_at),
            "decision_note": self.decision_note,
            "hold_since": iso(self.hold_since),
            "hold_note": self.hold_note,
            "hold_for_person": self.hold_for_person,
            "premature": self.premature,
        }


@dataclass(frozen=True, slots=True)
class NewExecution:
    """An execution to record (pending); `create_executions` fills the rest:
    status, who runs it (hostname, pid, pid_start) and the times."""

    runbook: str
    engine: str
    trigger: str
    who: str
    dry_run: bool = False
    alert_fingerprint: str | None = None
    alert_starts_at: datetime | None = None
    # ApprovalState.AWAITING for an execution that waits for a person.
    reason: str | None = None
    reverts_id: int | None = None
    # REFUSED: recorded final at once (an alert that names no one engine).
    status: ExecutionStatus = ExecutionStatus.PENDING
    episode_key: str | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.trigger not in TRIGGER_SOURCES:
            raise ValueError(f"trigger {self.trigger!r} not in {TRIGGER_SOURCES}")
        if self.trigger == "alert":
            if not self.alert_fingerprint or self.alert_starts_at is None:
                raise ValueError("an alert-triggered execution needs a fingerprint and startsAt")
            # One execution per episode (the evaluator's incidents are recorded
            # as alert episodes too); the schema checks key <=> trigger 'alert'.
            key = episode_key(
                self.runbook, self.engine, self.alert_fingerprint, self.alert_starts_at
            )
            object.__setattr__(self, "episode_key", key)

    def values(self) -> dict[str, Any]:
        """The row's columns this item decides."""
        return {
            "runbook": self.runbook,
            "engine": self.engine,
            "trigger": self.trigger,
            "who": self.who,
            "dry_run": self.dry_run,
            "alert_fingerprint": self.alert_fingerprint,
            "alert_starts_at": self.alert_starts_at,
            "episode_key": self.episode_key,
            "status": self.status,
            "reason": self.reason,
            "reverts_id": self.reverts_id,
        }


class ExecutionStore(StoreBase):
    """Executions, their steps, and what the guardrails ask of them."""

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
        new = NewExecution(
            runbook,
            engine,
            trigger=trigger,
            who=who,
            dry_run=dry_run,
            alert_fingerprint=alert_fingerprint,
            alert_starts_at=alert_starts_at,
            reason=reason,
            reverts_id=reverts_id,
        )
        with self.session(write=True) as s:
            [(execution_id, created)] = self.create_executions(s, [new])
            row = s.get(Execution, execution_id, options=[selectinload(Execution.steps)])
            assert row is not None
            return ExecutionRecord.from_row(row), created

    def create_executions(self, s: Session, new: Sequence[NewExecution]) -> list[tuple[int, bool]]:
        """Record pending executions in the caller's transaction `s` (the one
        way executions are created); returns (id, created) for each of `new`,
        in order.

        An alert episode is unique: one already in the journal (an earlier
        delivery, another replica) gives its id with created=False, and so
        does a repeat within `new` (the first one creates it). One executemany
        statement per kind whatever the number (SQLAlchemy's insertmanyvalues:
        one cached statement; a multi-row VALUES clause built per call would be
        compiled every time). Their events are appended before `s` commits.
        """
        if not new:
            return []
        now = utcnow()
        pid = os.getpid()
        stamp = {"hostname": HOSTNAME, "pid": pid, "pid_start": process_start(pid)}
        keyed: dict[str, dict[str, Any]] = {}  # episode key -> row, first one wins
        plain: list[dict[str, Any]] = []
        for item in new:
            values = {**item.values(), **stamp, "created_at": now, "updated_at": now}
            if values["episode_key"] is None:
                plain.append(values)
            else:
                keyed.setdefault(values["episode_key"], values)
        table = cast(Table, Execution.__table__)
        plain_ids: list[int] = []
        if plain:
            stmt = insert(table).returning(table.c.id, sort_by_parameter_order=True)
            plain_ids = list(s.execute(stmt, plain).scalars())
        created: dict[str, int] = {}
        if keyed:
            stmt = (
                self._insert()(table)
                .on_conflict_do_nothing(index_elements=["episode_key"])
                .returning(table.c.id, table.c.episode_key)
            )
            created = {str(key): id_ for id_, key in s.execute(stmt, list(keyed.values()))}
        touch_executions(s, [*plain_ids, *created.values()])  # their events commit with them
        ids = dict(created)
        missing = [key for key in keyed if key not in ids]
        if missing:
            found = s.execute(
                select(Execution.id, Execution.episode_key).where(
                    Execution.episode_key.in_(missing)
                )
            )
            ids.update({str(key): id_ for id_, key in found})
        fresh = iter(plain_ids)
        out: list[tuple[int, bool]] = []
        for item in new:
            key = item.episode_key
            if key is None:
                out.append((next(fresh), True))
            else:
                out.append((ids[key], created.pop(key, None) is not None))
        return out

    def transition(
        self,
        execution_id: int,
        new_status: ExecutionStatus | str,
        error: str | None = None,
        *,
        reason: str | None = None,
    ) -> ExecutionRecord:
        """Move an execution along its state machine; illegal moves raise.

        Entering 'running' stamps the current process as the runner (so a
        crash can be recognised later); a final status stamps finished_at.
        """
        if new_status not in EXECUTION_STATUSES:
            raise ValueError(f"status {new_status!r} not in {[str(v) for v in ExecutionStatus]}")
        new_status = ExecutionStatus(new_status)
        with self.session(write=True) as s:
            row = self._get_locked(s, execution_id)
            if new_status not in EXECUTION_TRANSITIONS[ExecutionStatus(row.status)]:
                raise IllegalTransition(execution_id, row.status, new_status)
            now = utcnow()
            row.status = new_status
            if new_status == ExecutionStatus.RUNNING:
                row.started_at = now
                row.hostname, row.pid = HOSTNAME, os.getpid()
                row.pid_start = process_start(row.pid)
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
        if not is_row_id(execution_id):
            raise ExecutionNotFound(execution_id)
        row = s.get(Execution, execution_id, with_for_update=True)
        if row is None:
            raise ExecutionNotFound(execution_id)
        return row

    def get_execution(self, execution_id: int) -> ExecutionRecord:
        if not is_row_id(execution_id):
            raise ExecutionNotFound(execution_id)
        with self.session() as s:
            row = s.get(Execution, execution_id, options=[selectinload(Execution.steps)])
            if row is None:
                raise ExecutionNotFound(execution_id)
            return ExecutionRecord.from_row(row)

    def executions_by_id(self, ids: Iterable[int]) -> dict[int, ExecutionRecord]:
        """The executions of `ids` that exist, with their steps, in one query."""
        wanted = sorted(set(ids))
        if not wanted:
            return {}
        query = (
            select(Execution).where(Execution.id.in_(wanted)).options(selectinload(Execution.steps))
        )
        with self.session() as s:
            return {r.id: ExecutionRecord.from_row(r) for r in s.scalars(query)}

    def list_executions(
        self,
        engine: str | None = None,
        *,
        runbook: str | None = None,
        who: str | None = None,
        limit: int = 50,
    ) -> list[ExecutionRecord]:
        """Newest first, with their steps."""
        query = select(Execution).options(selectinload(Execution.steps))
        if engine is not None:
            query = query.where(Execution.engine == engine)
        if who is not None:
            query = query.where(Execution.who == who)
        if runbook is not None:
            query = query.where(Execution.runbook == runbook)
        query = query.order_by(Execution.id.desc()).limit(limit)
        with self.session() as s:
            return [ExecutionRecord.from_row(r) for r in s.scalars(query)]

    def runnable_executions(self, *, after_id: int = 0, limit: int = 100) -> list[ExecutionRecord]:
        """Pending alert executions that wait for nobody (the worker's work),
        oldest first, from the partial index `ix_executions_runnable`: the
        cost is the number runnable, not the journal's size. `after_id` pages."""
        with self.session() as s:
            ids = list(
                s.scalars(text(runnable_ids_sql(self.dialect)), {"after": after_id, "limit": limit})
            )
            if not ids:
                return []
            query = (
                select(Execution)
                .where(Execution.id.in_(ids))
                .options(selectinload(Execution.steps))
                .order_by(Execution.id)
            )
            return [ExecutionRecord.from_row(r) for r in s.scalars(query)]

    def find_episode(
        self, runbook: str, engine: str, fingerprint: str, starts_at: datetime
    ) -> ExecutionRecord | None:
        """The execution an alert episode started, if any."""
        key = episode_key(runbook, engine, fingerprint, starts_at)
        query = (
            select(Execution)
            .where(Execution.episode_key == key)
            .options(selectinload(Execution.steps))
        )
        with self.session() as s:
            row = s.scalars(query).first()
            return None if row is None else ExecutionRecord.from_row(row)

    # --- the revert's hold and its judge (runbooks/run/revert.py) --------------------

    def hold(self, execution_id: int, note: str) -> ExecutionRecord:
        """Its alert resolved: the execution (succeeded or failed, its changes
        on the engine) holds them until the revert's conditions are met
        ("holding"); `note` says what it waits on."""
        with self.session(write=True) as s:
            row = self._get_locked(s, execution_id)
            if row.status not in HOLDABLE_STATUSES or row.hold_since is not None:
                raise IllegalTransition(execution_id, row.status, HOLDING)
            row.hold_since = utcnow()
            row.hold_note = note
            s.flush()
            return ExecutionRecord.from_row(row)

    def note_hold(
        self, execution_id: int, note: str, *, for_person: bool | None = None
    ) -> ExecutionRecord:
        """What a holding execution waits on now (written only when it changed)."""
        with self.session(write=True) as s:
            row = self._get_locked(s, execution_id)
            if row.hold_note != note:
                row.hold_note = note
            if for_person is not None and bool(row.hold_for_person) != for_person:
                row.hold_for_person = for_person
            s.flush()
            return ExecutionRecord.from_row(row)

    def holding_executions(self) -> list[ExecutionRecord]:
        """Executions holding their changes until their revert's conditions are met."""
        query = (
            select(Execution)
            .where(Execution.status.in_(HOLDABLE_STATUSES), Execution.hold_since.is_not(None))
            # Advice's hold_since is when its finding resolved: it holds nothing.
            .where(Execution.dry_run.is_(False))
            .options(selectinload(Execution.steps))
            .order_by(Execution.id)
        )
        with self.session() as s:
            return [ExecutionRecord.from_row(r) for r in s.scalars(query)]

    def mark_premature(self, revert_id: int, note: str) -> ExecutionRecord:
        """A revert whose finding came back inside its watch (it is re-applied)."""
        with self.session(write=True) as s:
            row = self._get_locked(s, revert_id)
            row.premature = True
            row.reason = f"{row.reason}; {note}" if row.reason else note
            s.flush()
            return ExecutionRecord.from_row(row)

    def last_revert(self, runbook: str, engine: str) -> ExecutionRecord | None:
        """The newest revert of `runbook` on `engine` that finished and changed
        something (the judge of reverts watches it)."""
        query = (
            select(Execution)
            .where(
                Execution.runbook == runbook,
                Execution.engine == engine,
                Execution.reverts_id.is_not(None),
                Execution.status == ExecutionStatus.SUCCEEDED,
            )
            .options(selectinload(Execution.steps))
            .order_by(Execution.id.desc())
            .limit(1)
        )
        with self.session() as s:
            row = s.scalars(query).first()
            return None if row is None else ExecutionRecord.from_row(row)

    def knob_changes_since(self, runbook: str, engine: str, since: datetime) -> int:
        """Executions of `runbook` on `engine` started at or after `since` that
        changed a knob (fixes, reverts and re-applies alike): each one after
        the first turned the knobs round."""
        if since.tzinfo is None:
            raise ValueError("since must be timezone-aware")
        query = (
            select(Execution)
            .where(
                Execution.runbook == runbook,
                Execution.engine == engine,
                Execution.dry_run.is_(False),
                Execution.started_at >= since,
            )
            .options(selectinload(Execution.steps))
        )
        changed = (STEP_APPLIED, STEP_REVERTED)
        with self.session() as s:
            return sum(
                1
                for row in s.scalars(query)
                if any(step.status in changed and step.before for step in row.steps)
            )

    # --- guardrail queries (asked under the executor's admission lease) ---------------

    @staticmethod
    def _real_runs(runbook: str, engine: str) -> Select[datetime | None]:
        # What counts for cooldown and rate limits: runs that started for real.
        # Dry runs changed nothing, refusals never ran, and a revert restores
        # (it is not remediation and must not extend the cooldown).
        return select(Execution.started_at).where(
            Execution.runbook == runbook,
            Execution.engine == engine,
            Execution.dry_run.is_(False),
            Execution.status != ExecutionStatus.REFUSED,
            Execution.started_at.is_not(None),
            Execution.reverts_id.is_(None),
        )

    def last_run_started(self, runbook: str, engine: str) -> datetime | None:
        """When the latest real run of a runbook on an engine started (the cooldown)."""
        query = self._real_runs(runbook, engine).order_by(Execution.started_at.desc()).limit(1)
        with self.session() as s:
            return s.scalar(query)

    def runs_started_since(self, runbook: str, engine: str, since: datetime) -> list[datetime]:
        """Start times of the real runs started at or after `since`, oldest
        first (max runs per hour: how many, and when the oldest leaves the hour)."""
        if since.tzinfo is None:
            raise ValueError("since must be timezone-aware")
        query = (
            self._real_runs(runbook, engine)
            .where(Execution.started_at >= since)
            .order_by(Execution.started_at)
        )
        with self.session() as s:
            return [started for started in s.scalars(query) if started is not None]

    def engines_under_remediation(self, *, other_than: str | None = None) -> set[str]:
        """Engines with a real remediation running or verifying (the blast radius).

        Pending executions have not acted yet, dry runs never act, and a
        revert restores; `other_than` leaves out the engine asking.
        """
        query = select(Execution.engine).where(
            Execution.status.in_((ExecutionStatus.RUNNING, ExecutionStatus.VERIFYING)),
            Execution.dry_run.is_(False),
            Execution.reverts_id.is_(None),
        )
        if other_than is not None:
            query = query.where(Execution.engine != other_than)
        with self.session() as s:
            return set(s.scalars(query.distinct()))

    def finished_since(self, since: datetime) -> list[ExecutionRecord]:
        """Real executions (reverts included) that finished at or after
        `since`, oldest first: what the circuit breaker may watch
        (vllm_runbook.runbooks.service.breaker)."""
        if since.tzinfo is None:
            raise ValueError("since must be timezone-aware")
        query = (
            select(Execution)
            .where(
                Execution.finished_at >= since,
                Execution.dry_run.is_(False),
                Execution.started_at.is_not(None),
            )
            .options(selectinload(Execution.steps))
            .order_by(Execution.finished_at, Execution.id)
        )
        with self.session() as s:
            return [ExecutionRecord.from_row(r) for r in s.scalars(query)]

    def started_by_since(self, who: str, engine: str, since: datetime) -> list[ExecutionRecord]:
        """The executions `who` started on `engine` at or after `since`, newest
        first, with their steps (the breaker's holds: what each one judged)."""
        query = (
            select(Execution)
            .where(Execution.who == who, Execution.engine == engine)
            .where(Execution.started_at >= since)
            .options(selectinload(Execution.steps))
            .order_by(Execution.started_at.desc(), Execution.id.desc())
        )
        with self.session() as s:
            return [ExecutionRecord.from_row(r) for r in s.scalars(query)]

    def last_started_by(self, who: str, engine: str) -> datetime | None:
        """When the latest execution `who` started on `engine` began (the breaker's hold)."""
        query = (
            select(Execution.started_at)
            .where(Execution.who == who, Execution.engine == engine)
            .where(Execution.started_at.is_not(None))
            .order_by(Execution.started_at.desc())
            .limit(1)
        )
        with self.session() as s:
            return s.scalar(query)

    def recover_interrupted(self) -> list[int]:
        """Mark active executions whose process died on this host as failed.

        Steps left 'applying' become 'interrupted' (their effect is unknown;
        their before-values still allow a revert). Executions run from other
        hosts are left alone: their liveness cannot be judged from here.
        Returns the ids marked.
        """
        query = select(
            Execution.id, Execution.pid, Execution.pid_start, Execution.status, Execution.trigger
        ).where(Execution.status.in_(ACTIVE_STATUSES), Execution.hostname == HOSTNAME)
        with self.session() as s:
            candidates = [
                row.id
                for row in s.execute(query)
                if runs_in_its_process(row.status, row.trigger)
                and row.pid is not None
                and not process_alive(row.pid, row.pid_start)
            ]
        recovered: list[int] = []
        for execution_id in candidates:
            with self.session(write=True) as s:
                row = self._get_locked(s, execution_id)
                # Re-check under the lock: another process may have got there.
                if not runs_in_its_process(row.status, row.trigger):
                    continue
                now = utcnow()
                row.status, row.error, row.finished_at = (
                    ExecutionStatus.FAILED,
                    INTERRUPTED_REASON,
                    now,
                )
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

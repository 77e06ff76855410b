"""Approvals in the journal: executions awaiting a person, and their answers.

An execution of an `approve`-mode runbook is recorded pending with the reason
"awaiting approval". A person approves it (the service's worker then runs it,
exactly once across replicas: the worker's lease) or rejects it (refused,
with who and why). Three things close the question without a person:
- expiry: nobody answered within the configured time → refused, "expired";
- the alert resolved first → refused, "alert resolved before approval";
- an answer that comes after any of these changes nothing and says why.

Every decision is taken under the execution's row lock, so an approval and a
rejection (or an expiry) racing each other leave one answer in the journal.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final

from sqlalchemy import bindparam, func, select, text
from sqlalchemy.orm import selectinload
from vllm_runbook.runbooks.store.base import StoreBase
from vllm_runbook.runbooks.store.errors import ExecutionNotFound, InvalidInput
from vllm_runbook.runbooks.store.executions import ExecutionRecord
from vllm_runbook.runbooks.store.models import (
    AWAITING_SQL,
    ApprovalState,
    Execution,
    ExecutionStatus,
    UTCDateTime,
    episode_key,
    is_row_id,
    utcnow,
)

DEFAULT_APPROVAL_TIMEOUT_S: Final = 15 * 60.0
RESOLVED_BEFORE_APPROVAL: Final = "alert resolved before approval"
# An automatic execution still pending when its alert resolved: acting on a
# resolved alert would change an engine nothing reverts.
RESOLVED_BEFORE_RUN: Final = "alert resolved before it ran"
EXPIRED_PREFIX: Final = "approval expired"
# A decision's note is a sentence or a paragraph, kept in the journal and shown
# on the page and in notifications: longer text is refused, not truncated.
MAX_NOTE_CHARS: Final = 4096

# Outcomes of `decide` (what the CLI, the API and the page tell the person).
DECIDED: Final = "decided"
TOO_LATE: Final = "too late"
NOT_AWAITING: Final = "not awaiting approval"


@dataclass(frozen=True)
class PendingPage:
    """One page of the executions awaiting a person (`pending_page`)."""

    records: list[ExecutionRecord]
    total: int
    """How many await a person under the same filters, this page included."""
    rest: int
    """How many of them come after this page (older)."""


@dataclass(frozen=True)
class Decision:
    """What an approve/reject did: `outcome` is DECIDED, TOO_LATE or NOT_AWAITING."""

    record: ExecutionRecord
    outcome: str
    message: str

    @property
    def ok(self) -> bool:
        return self.outcome == DECIDED


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min" + (f" {secs} s" if secs else "") if minutes else f"{secs} s"


def expired_reason(timeout_s: float) -> str:
    return f"{EXPIRED_PREFIX}: nobody approved within {_duration(timeout_s)}"


def _is_awaiting(row: Execution) -> bool:
    return (
        row.status == ExecutionStatus.PENDING
        and row.reason == ApprovalState.AWAITING
        and row.decision is None
    )


def _why_not(row: Execution) -> tuple[str, str]:
    """(outcome, message) for an execution that no longer awaits approval."""
    label = f"execution #{row.id} ({row.runbook})"
    if row.decision is not None:
        when = row.decided_at.strftime("%H:%M:%SZ") if row.decided_at else "?"
        return TOO_LATE, f"{label} was already {row.decision} by {row.decided_by} at {when}"
    if row.status == ExecutionStatus.REFUSED and row.reason == RESOLVED_BEFORE_APPROVAL:
        return TOO_LATE, f"{label}: the alert resolved before approval; nothing runs"
    if row.status == ExecutionStatus.REFUSED and (row.reason or "").startswith(EXPIRED_PREFIX):
        return TOO_LATE, f"{label}: {row.reason}; nothing runs"
    return NOT_AWAITING, f"{label} is {row.status}, not awaiting approval"


def expired_ids_sql(dialect: str) -> str:
    """The expiry's query (bind `cutoff`), from the partial index
    ix_executions_awaiting: the work is the number expiring, not the number
    awaiting or the journal's size. SQLite without statistics would take
    ix_executions_status: the index is named there."""
    index = " INDEXED BY ix_executions_awaiting" if dialect == "sqlite" else ""
    return (
        f"SELECT id FROM executions{index} WHERE {AWAITING_SQL} AND decision IS NULL "
        "AND created_at <= :cutoff ORDER BY created_at"
    )


class ApprovalStore(StoreBase):
    """Executions awaiting approval and the decisions on them."""

    def pending_approvals(self) -> list[ExecutionRecord]:
        """Executions awaiting a person's answer, oldest first (all of them)."""
        query = (
            select(Execution)
            .where(text(AWAITING_SQL), Execution.decision.is_(None))
            .options(selectinload(Execution.steps))
            .order_by(Execution.id)
        )
        with self.session() as s:
            return [ExecutionRecord.from_row(r) for r in s.scalars(query)]

    @staticmethod
    def _awaiting(engine: str | None, runbook: str | None, before: int | None) -> Any:
        where = [text(AWAITING_SQL), Execution.decision.is_(None)]
        if engine is not None:
            where.append(Execution.engine == engine)
        if runbook is not None:
            where.append(Execution.runbook == runbook)
        if before is not None:
            # Row ids are 1 … 2³¹−1: a larger bound is no bound (and SQLite's
            # integers end at 2⁶³).
            where.append(Execution.id < max(0, min(before, 2**31)))
        return where

    def pending_page(
        self,
        *,
        limit: int,
        engine: str | None = None,
        runbook: str | None = None,
        before: int | None = None,
    ) -> PendingPage:
        """At most `limit` executions awaiting a person's answer, newest first,
        of `engine` and `runbook` when given, with ids below `before` when
        given (the next page: `before` = the last id shown); and how many
        match in all and after this page."""
        where = self._awaiting(engine, runbook, before)
        query = (
            select(Execution)
            .where(*where)
            .options(selectinload(Execution.steps))
            .order_by(Execution.id.desc())
            .limit(limit)
        )
        with self.session() as s:
            records = [ExecutionRecord.from_row(r) for r in s.scalars(query)]
            total = s.scalar(select(func.count()).where(*self._awaiting(engine, runbook, None)))
            rest = 0
            if len(records) == limit:
                after = self._awaiting(engine, runbook, records[-1].id)
                rest = s.scalar(select(func.count()).where(*after)) or 0
        return PendingPage(records, total or 0, rest)

    def pending_counts(self) -> list[tuple[str, str, int]]:
        """(engine, runbook, how many await a person) for every pair with one,
        the most first."""
        count = func.count().label("n")
        query = (
            select(Execution.engine, Execution.runbook, count)
            .where(*self._awaiting(None, None, None))
            .group_by(Execution.engine, Execution.runbook)
            .order_by(count.desc(), Execution.engine, Execution.runbook)
        )
        with self.session() as s:
            return [(e, r, int(n)) for e, r, n in s.execute(query)]

    def decide(
        self,
        execution_id: int,
        decision: str,
        who: str,
        note: str | None = None,
        *,
        timeout_s: float = DEFAULT_APPROVAL_TIMEOUT_S,
        now: datetime | None = None,
    ) -> Decision:
        """Approve or reject an execution awaiting approval.

        Approved: the reason is cleared, so the worker runs it (with consent).
        Rejected: refused with "rejected by WHO: NOTE". An execution whose
        approval time ran out is refused as expired here and then, and the
        answer is TOO_LATE. Raises ExecutionNotFound for an unknown id,
        InvalidInput for a note over MAX_NOTE_CHARS.
        """
        if decision not in (ApprovalState.APPROVED, ApprovalState.REJECTED):
            choices = " or ".join(
                repr(str(d)) for d in (ApprovalState.APPROVED, ApprovalState.REJECTED)
            )
            raise ValueError(f"decision {decision!r} is not {choices}")
        if note is not None and len(note) > MAX_NOTE_CHARS:
            raise InvalidInput(
                f"the note has {len(note)} characters; at most {MAX_NOTE_CHARS} are kept"
            )
        if not is_row_id(execution_id):
            raise ExecutionNotFound(execution_id)
        now = now or utcnow()
        with self.session(write=True) as s:
            row = s.get(Execution, execution_id, with_for_update=True)
            if row is None:
                raise ExecutionNotFound(execution_id)
            if _is_awaiting(row) and row.created_at + timedelta(seconds=timeout_s) <= now:
                self._refuse(row, expired_reason(timeout_s), now)
            if not _is_awaiting(row):
                outcome, message = _why_not(row)
                s.flush()
                return Decision(ExecutionRecord.from_row(row), outcome, message)
            row.decision, row.decided_by, row.decided_at = decision, who, now
            row.decision_note = note or None
            label = f"execution #{row.id} ({row.runbook} on {row.engine})"
            if decision == ApprovalState.APPROVED:
                row.reason = None  # no longer awaiting: the worker picks it up
                message = f"{label} approved by {who}; the service runs it"
            else:
                self._refuse(row, f"rejected by {who}" + (f": {note}" if note else ""), now)
                message = f"{label} rejected by {who}; nothing runs"
            s.flush()
            return Decision(ExecutionRecord.from_row(row), DECIDED, message)

    def expire_approvals(
        self, timeout_s: float = DEFAULT_APPROVAL_TIMEOUT_S, *, now: datetime | None = None
    ) -> list[ExecutionRecord]:
        """Refuse every execution that awaited approval for `timeout_s` or more."""
        now = now or utcnow()
        cutoff = now - timedelta(seconds=timeout_s)
        with self.session() as s:
            # Stored as naive UTC: the column type converts the bound value.
            query = text(expired_ids_sql(self.dialect)).bindparams(
                bindparam("cutoff", cutoff, type_=UTCDateTime())
            )
            ids = list(s.scalars(query))
        expired = []
        for execution_id in ids:
            with self.session(write=True) as s:
                row = s.get(Execution, execution_id, with_for_update=True)
                if row is None or not _is_awaiting(row):
                    continue  # answered meanwhile
                self._refuse(row, expired_reason(timeout_s), now)
                s.flush()
                expired.append(ExecutionRecord.from_row(row))
        return expired

    def resolve_before_start(
        self, runbook: str, engine: str, fingerprint: str, starts_at: datetime
    ) -> ExecutionRecord | None:
        """The alert episode resolved: an execution that has not started is
        refused. One waiting for a person (or approved, not started) so that a
        late approval runs nothing; an automatic one still queued (the worker
        was busy) so that nothing changes an engine after the reason went away:
        its revert on resolve has already been and gone."""
        key = episode_key(runbook, engine, fingerprint, starts_at)
        with self.session(write=True) as s:
            row = s.scalars(
                select(Execution).where(Execution.episode_key == key).with_for_update()
            ).first()
            if row is None or row.status != ExecutionStatus.PENDING:
                return None
            person = _is_awaiting(row) or row.decision == ApprovalState.APPROVED
            self._refuse(row, RESOLVED_BEFORE_APPROVAL if person else RESOLVED_BEFORE_RUN, utcnow())
            s.flush()
            return ExecutionRecord.from_row(row)

    @staticmethod
    def _refuse(row: Execution, reason: str, now: datetime) -> None:
        row.status, row.reason, row.finished_at = ExecutionStatus.REFUSED, reason, now

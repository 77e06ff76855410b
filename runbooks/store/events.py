"""Execution events: appended in the transaction that changes the execution.

An execution's events follow from its row: awaiting approval, started, then
one outcome (succeeded | no measurable change | failed | rolled back |
refused | nothing to improve | interrupted), and reverted (`derive_events`);
advisory mode's advice has one: advised. Every transaction of
the store that touched an execution appends the events its rows now imply
and that are not recorded yet, just before it commits (`install` hooks the
store's sessions). So whatever writes the journal — the webhook, the worker,
`runbook exec`, `runbook approve` on another machine — records its events in
the same commit as the change: none can be lost between the two, and each
has one row, one id and one key, whatever the number of replicas.

Event ids are the notifier's cursor (notify.py), so they must become visible
in id order: on PostgreSQL the appending transaction takes a transaction-scoped
advisory lock before it draws ids and holds it until it commits (a sequence
alone hands out ids in call order, and a later id can commit first); SQLite
has one writer at a time anyway. The lock is taken only by transactions that
append, at their very end.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any, Final

from sqlalchemy import event as sa_event
from sqlalchemy import select, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, UOWTransaction, sessionmaker
from vllm_runbook.runbooks.store.models import (
    ADVISED,
    INTERRUPTED_REASON,
    NOTHING_TO_IMPROVE,
    ApprovalState,
    Execution,
    ExecutionEvent,
    ExecutionStatus,
    is_advised,
    is_nothing_to_improve,
    utcnow,
)

AWAITING: Final = "awaiting approval"
STARTED: Final = "started"
NO_CHANGE: Final = "no measurable change"
INTERRUPTED: Final = "interrupted"
HOLDING: Final = "holding"
HELD_FOR_PERSON: Final = "held for a person"
PREMATURE: Final = "premature revert"
EVENTS: Final = (
    AWAITING,
    STARTED,
    "succeeded",
    NO_CHANGE,
    "failed",
    "rolled back",
    "refused",
    NOTHING_TO_IMPROVE,
    INTERRUPTED,
    HOLDING,
    HELD_FOR_PERSON,
    "reverted",
    PREMATURE,
    ADVISED,
)
_ORDER: Final = {name: i for i, name in enumerate(EVENTS)}

# Any constant works; the same in every process (the migrations' lock is another).
_PG_EVENTS_LOCK_ID: Final = 0x72756E6576  # "runev"
_TOUCHED: Final = "runbook_touched_executions"
_CHUNK: Final = 500  # ids per IN (...) list


def derive_events(
    *,
    dry_run: bool,
    reverts_id: int | None,
    reason: str | None,
    decision: str | None,
    started_at: Any,
    status: str,
    error: str | None,
    verification: dict[str, Any] | None,
    interrupted: bool = False,
    hold_since: Any = None,
    hold_for_person: bool = False,
    premature: bool = False,
    trigger: str = "cli",
) -> list[str]:
    """The events an execution's state implies so far, in order.

    Dry runs and reverts (executions that restore another) are not
    remediations: they have no events (the reverted one says `reverted`),
    but a revert found premature says so (its fix was re-applied). An
    execution that held its changes after its alert resolved says `holding`
    (and `held for a person` once only a person may release it). Advisory
    mode's advice (an alert's dry run) says `advised` once it is decided.
    """
    if is_advised(dry_run, trigger):
        return [ADVISED] if status == ExecutionStatus.SUCCEEDED else []
    if dry_run:
        return []
    if reverts_id is not None:
        return [PREMATURE] if premature else []
    events = []
    if reason == ApprovalState.AWAITING or decision is not None:
        events.append(AWAITING)
    if started_at is not None:
        events.append(STARTED)
    if interrupted or (status == ExecutionStatus.FAILED and error == INTERRUPTED_REASON):
        events.append(INTERRUPTED)
    elif status == ExecutionStatus.FAILED:
        outcome = (verification or {}).get("outcome")
        events.append(NO_CHANGE if outcome == "not improved" else "failed")
    elif status == ExecutionStatus.SUCCEEDED:
        events.append("succeeded")
    elif status == ExecutionStatus.ROLLED_BACK:
        events.append("rolled back")
    elif is_nothing_to_improve(status, reason):
        events.append(NOTHING_TO_IMPROVE)
    elif status == ExecutionStatus.REFUSED:
        events.append("refused")
    if hold_since is not None:
        events.append(HOLDING)
    if hold_for_person:
        events.append(HELD_FOR_PERSON)
    if status == ExecutionStatus.REVERTED:
        events.append("reverted")
    return events


def touch_executions(session: Session, ids: Iterable[int]) -> None:
    """Executions written with Core statements (the ORM's writes are seen by
    themselves): their events are appended before this transaction commits."""
    session.info.setdefault(_TOUCHED, set()).update(ids)


def install(factory: sessionmaker[Session]) -> None:
    """Append the events of the executions each session's transaction touched."""
    sa_event.listen(factory, "after_flush", _note_flushed)
    sa_event.listen(factory, "before_commit", _append_before_commit)


def _note_flushed(session: Session, _context: UOWTransaction) -> None:
    # new/dirty still hold what this flush wrote (they are reset after it).
    ids = [
        obj.id
        for obj in (*session.new, *session.dirty)
        if isinstance(obj, Execution) and obj.id is not None
    ]
    if ids:
        touch_executions(session, ids)


def _append_before_commit(session: Session) -> None:
    session.flush()  # the last changes, so that _note_flushed has seen them
    ids = session.info.pop(_TOUCHED, None)
    if ids:
        append_events(session, sorted(ids))


def append_events(session: Session, ids: list[int]) -> int:
    """Record the events the executions `ids` imply that are not recorded yet;
    returns how many were appended."""
    wanted: set[tuple[int, str]] = set()
    have: set[tuple[int, str]] = set()
    for start in range(0, len(ids), _CHUNK):
        chunk = ids[start : start + _CHUNK]
        rows = session.execute(
            select(
                Execution.id,
                Execution.dry_run,
                Execution.reverts_id,
                Execution.reason,
                Execution.decision,
                Execution.started_at,
                Execution.status,
                Execution.error,
                Execution.verification,
                Execution.hold_since,
                Execution.hold_for_person,
                Execution.premature,
                Execution.trigger,
            ).where(Execution.id.in_(chunk))
        )
        for row in rows:
            fields = row._asdict()
            execution_id = fields.pop("id")
            wanted.update((execution_id, e) for e in derive_events(**fields))
        have.update(
            (r.execution_id, r.event)
            for r in session.execute(
                select(ExecutionEvent.execution_id, ExecutionEvent.event).where(
                    ExecutionEvent.execution_id.in_(chunk)
                )
            )
        )
    missing = sorted(wanted - have, key=lambda pair: (pair[0], _ORDER[pair[1]]))
    if not missing:
        return 0
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        # Held until this transaction ends: ids become visible in order.
        session.execute(text(f"SELECT pg_advisory_xact_lock({_PG_EVENTS_LOCK_ID})"))
        insert: Any = postgresql.insert
    else:
        insert = sqlite.insert
    now = utcnow()
    # Another transaction may have appended one of them since we looked:
    # the unique (execution, event) keeps the first.
    table = ExecutionEvent.__table__
    session.execute(
        insert(table).on_conflict_do_nothing(index_elements=["execution_id", "event"]),
        [
            {"execution_id": e, "event": name, "key": str(uuid.uuid4()), "created_at": now}
            for e, name in missing
        ],
    )
    return len(missing)

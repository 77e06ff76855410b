"""Tables of the runbook journal and the service's durable state.

The schema is owned by Alembic (`runbooks/store/migrations/versions/`); these
models are its single source (`target_metadata = Base.metadata`), so a model
change without a migration fails `alembic check`.

Design points:
- Timestamps are stored as naive UTC and handed back timezone-aware
  (`UTCDateTime`): SQLite has no time zones, and one convention for both
  dialects keeps comparisons (cooldown, leases) exact.
- Uniqueness that must hold across processes and replicas lives in the
  database, as unique constraints on computed non-null keys: `episode_key`
  for alert-triggered executions (NULL for CLI runs, and NULLs never collide)
  and `open_key` for open incidents. A NULL-able composite unique constraint
  would let (runbook, engine, NULL, NULL) duplicates through.
- Statuses are strings with CHECK constraints generated from their enums
  (`ExecutionStatus`, stored as the members' values); the legal moves between
  them are `EXECUTION_TRANSITIONS`, enforced by the store in code.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Final

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    event,
    false,
    text,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

NAMING_CONVENTION: Final = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# --- execution state machine -------------------------------------------------


class ExecutionStatus(StrEnum):
    """Where an execution is; the stored value is the member's string."""

    PENDING = "pending"
    RUNNING = "running"
    VERIFYING = "verifying"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    ROLLED_BACK = "rolled_back"
    REVERTED = "reverted"
    # A guardrail said no (cooldown, max runs, blast radius, no approval):
    # recorded so the operator sees it, but it is not a run and counts for no
    # guardrail.
    REFUSED = "refused"


class ApprovalState(StrEnum):
    """A pending execution's approval: AWAITING is its `reason` while a
    person has not answered; APPROVED / REJECTED are the answer (`decision`)."""

    AWAITING = "awaiting approval"
    APPROVED = "approved"
    REJECTED = "rejected"


EXECUTION_STATUSES: Final = tuple(ExecutionStatus)
# What a person is shown for a succeeded or failed execution whose alert
# resolved and whose revert waits for its cause to go (`hold_since` set).
HOLDING: Final = "holding"
# What a person is shown for advisory mode's advice (runbooks/run/advisory.py):
# a dry run an alert or a rule started, finished; it changed nothing.
ADVISED: Final = "advised"
ADVISORY_TRIGGERS: Final = frozenset({"alert", "rule"})


def is_advised(dry_run: bool, trigger: str) -> bool:
    """An alert's or a rule's dry run: advisory mode's advice."""
    return dry_run and trigger in ADVISORY_TRIGGERS


HOLDABLE_STATUSES: Final = frozenset({ExecutionStatus.SUCCEEDED, ExecutionStatus.FAILED})
ACTIVE_STATUSES: Final = frozenset(
    {ExecutionStatus.PENDING, ExecutionStatus.RUNNING, ExecutionStatus.VERIFYING}
)
FINAL_STATUSES: Final = frozenset(ExecutionStatus) - ACTIVE_STATUSES

EXECUTION_TRANSITIONS: Final[dict[ExecutionStatus, frozenset[ExecutionStatus]]] = {
    ExecutionStatus.PENDING: frozenset(
        {ExecutionStatus.RUNNING, ExecutionStatus.FAILED, ExecutionStatus.REFUSED}
    ),
    # running → succeeded: runbooks without verification (advice, diagnostics).
    # running → rolled_back: a step failed and the applied ones were undone.
    ExecutionStatus.RUNNING: frozenset(
        {
            ExecutionStatus.VERIFYING,
            ExecutionStatus.SUCCEEDED,
            ExecutionStatus.FAILED,
            ExecutionStatus.ROLLED_BACK,
        }
    ),
    ExecutionStatus.VERIFYING: frozenset(
        {ExecutionStatus.SUCCEEDED, ExecutionStatus.FAILED, ExecutionStatus.ROLLED_BACK}
    ),
    # Reverting restores the recorded before-values: after success (alert
    # resolved, `runbook revert`) or after a failure that left changes behind
    # (an interrupted run).
    ExecutionStatus.SUCCEEDED: frozenset({ExecutionStatus.REVERTED}),
    ExecutionStatus.FAILED: frozenset({ExecutionStatus.REVERTED}),
    ExecutionStatus.ROLLED_BACK: frozenset(),
    ExecutionStatus.REVERTED: frozenset(),
    ExecutionStatus.REFUSED: frozenset(),
}

TRIGGER_SOURCES: Final = ("cli", "alert", "rule")

# --- step statuses -------------------------------------------------------------

STEP_PLANNED = "planned"  # dry-run: what would change, nothing applied
STEP_SKIPPED = "skipped"  # its condition did not hold
STEP_APPLYING = "applying"  # before-values recorded, action running (committed first)
STEP_APPLIED = "applied"
STEP_FAILED = "failed"
STEP_INTERRUPTED = "interrupted"  # the process died while applying: effect unknown
STEP_REVERTED = "reverted"
STEP_STATUSES: Final = (
    STEP_PLANNED,
    STEP_SKIPPED,
    STEP_APPLYING,
    STEP_APPLIED,
    STEP_FAILED,
    STEP_INTERRUPTED,
    STEP_REVERTED,
)

INCIDENT_STATES: Final = ("pending", "firing", "resolved")

# Notification deliveries: queued, then delivered or failed (after retries).
NOTIFY_QUEUED, NOTIFY_DELIVERED, NOTIFY_FAILED = "queued", "delivered", "failed"
NOTIFICATION_STATUSES: Final = (NOTIFY_QUEUED, NOTIFY_DELIVERED, NOTIFY_FAILED)
INTERRUPTED_REASON: Final = "interrupted"
# A refusal that is no failure: the condition the runbook fixes is gone or below
# its threshold at the checks (the `reason` starts with it; shown and notified
# under this name). Nothing was changed; like every refusal it counts for no
# guardrail.
NOTHING_TO_IMPROVE: Final = "nothing to improve"


def is_nothing_to_improve(status: str, reason: str | None) -> bool:
    return status == ExecutionStatus.REFUSED and (reason or "").startswith(NOTHING_TO_IMPROVE)


# What the worker runs: pending alert executions that wait for nobody. One SQL
# text for the partial index and for the worker's query, with literal values:
# SQLite uses a partial index only for a query whose WHERE holds the index's
# terms as written (a bound parameter does not match a literal).
RUNNABLE_SQL: Final = (
    f"status = '{ExecutionStatus.PENDING}' AND \"trigger\" IN ('alert', 'rule') "
    f"AND (reason IS NULL OR reason <> '{ApprovalState.AWAITING}')"
)
# What awaits a person (the approvals' expiry and the pending list).
AWAITING_SQL: Final = (
    f"status = '{ExecutionStatus.PENDING}' AND reason = '{ApprovalState.AWAITING}'"
)


# Row ids are INTEGER columns: 32-bit on PostgreSQL. An id outside can name no
# row, and asking the database for it is an error there (and on SQLite beyond
# 64 bits): lookups answer "no such execution" instead.
MAX_ROW_ID: Final = 2**31 - 1


def is_row_id(value: int) -> bool:
    return 1 <= value <= MAX_ROW_ID


def _in(column: str, values: tuple[str, ...]) -> str:
    # str(): an enum member's stored value (its repr names the class).
    return f"{column} IN ({', '.join(repr(str(v)) for v in values)})"


def _key(*parts: object) -> str:
    # JSON keeps the parts apart whatever characters they hold; sha256 keeps
    # the indexed column short whatever the engine URL's length.
    return hashlib.sha256(json.dumps(parts, separators=(",", ":")).encode()).hexdigest()


def episode_key(runbook: str, engine: str, fingerprint: str, starts_at: datetime) -> str:
    """The identity of one alert episode for one runbook on one engine.

    Alertmanager redelivers and HA peers duplicate; all of those carry the same
    (fingerprint, startsAt), so they map to one key and one execution.
    """
    if starts_at.tzinfo is None:
        raise ValueError("starts_at must be timezone-aware")
    return _key(runbook, engine, fingerprint, starts_at.astimezone(UTC).isoformat())


def incident_open_key(alert: str, engine: str) -> str:
    return _key(alert, engine)


# --- types ---------------------------------------------------------------------


class UTCDateTime(TypeDecorator[datetime]):
    """Aware datetimes in, naive UTC in the database, aware UTC out."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: pass an aware (UTC) datetime")
        return value.astimezone(UTC).replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return None if value is None else value.replace(tzinfo=UTC)


JsonDocument = JSON().with_variant(postgresql.JSONB(), "postgresql")


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


# --- tables --------------------------------------------------------------------


class Execution(Base):
    """One run of one runbook against one engine (or one refusal to run)."""

    __tablename__ = "executions"
    __table_args__ = (
        CheckConstraint(_in("status", EXECUTION_STATUSES), name="status"),
        CheckConstraint(_in("trigger", TRIGGER_SOURCES), name="trigger"),
        # Alert runs must carry their episode; others must not claim one.
        CheckConstraint(
            "(trigger = 'alert') = (episode_key IS NOT NULL)", name="episode_key_iff_alert"
        ),
        UniqueConstraint("episode_key"),
        Index("ix_executions_runbook_engine_started", "runbook", "engine", "started_at"),
        Index("ix_executions_engine_id", "engine", "id"),
        Index("ix_executions_status", "status"),
        # Partial indexes: the worker's and the expiry's queries read only the
        # rows they want, whatever the number of finished executions (or of
        # executions awaiting a person, for the worker).
        Index(
            "ix_executions_runnable",
            "id",
            sqlite_where=text(RUNNABLE_SQL),
            postgresql_where=text(RUNNABLE_SQL),
        ),
        Index(
            "ix_executions_awaiting",
            "created_at",
            sqlite_where=text(AWAITING_SQL),
            postgresql_where=text(AWAITING_SQL),
        ),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    runbook: Mapped[str] = mapped_column(String(64))
    engine: Mapped[str] = mapped_column(String(512))
    trigger: Mapped[str] = mapped_column(String(8))
    who: Mapped[str] = mapped_column(String(256))
    alert_fingerprint: Mapped[str | None] = mapped_column(String(64))
    alert_starts_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    episode_key: Mapped[str | None] = mapped_column(String(64))
    dry_run: Mapped[bool] = mapped_column(Boolean, default=False)
    status: Mapped[str] = mapped_column(String(16), default=ExecutionStatus.PENDING)
    reason: Mapped[str | None] = mapped_column(Text)
    error: Mapped[str | None] = mapped_column(Text)
    # Results of the runbook's checks and of its verification, as shown to the
    # operator; kept so a report can be rendered again from the journal alone.
    checks: Mapped[dict[str, Any] | None] = mapped_column(JsonDocument)
    verification: Mapped[dict[str, Any] | None] = mapped_column(JsonDocument)
    reverts_id: Mapped[int | None] = mapped_column(ForeignKey("executions.id"))
    # Who is running it: lets a later process tell a live run from a dead one.
    hostname: Mapped[str | None] = mapped_column(String(255))
    pid: Mapped[int | None] = mapped_column(Integer)
    # Process start time (Linux clock ticks since boot) guards against pid reuse.
    pid_start: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)
    # A person's answer to an execution awaiting approval (approvals.py):
    # 'approved' or 'rejected', by whom, when, and the note they gave.
    decision: Mapped[str | None] = mapped_column(String(16))
    decided_by: Mapped[str | None] = mapped_column(String(256))
    decided_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    decision_note: Mapped[str | None] = mapped_column(Text)
    # The revert's hold: since when its alert resolved (a succeeded or failed
    # execution with a hold_since is "holding": its changes stay until the
    # cause is gone), what it waits on now, and whether only a person may
    # release it.
    hold_since: Mapped[datetime | None] = mapped_column(UTCDateTime)
    hold_note: Mapped[str | None] = mapped_column(Text)
    hold_for_person: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # A revert whose finding came back inside its watch: re-applied.
    premature: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())

    steps: Mapped[list[Step]] = relationship(
        back_populates="execution", order_by="Step.ordinal", cascade="all, delete-orphan"
    )


class Step(Base):
    """One action of an execution, with the knob values before and after it."""

    __tablename__ = "steps"
    __table_args__ = (
        CheckConstraint(_in("status", STEP_STATUSES), name="status"),
        UniqueConstraint("execution_id", "ordinal"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    execution_id: Mapped[int] = mapped_column(
        ForeignKey("executions.id", ondelete="CASCADE"), index=True
    )
    ordinal: Mapped[int] = mapped_column(Integer)
    action: Mapped[str] = mapped_column(String(64))
    params: Mapped[dict[str, Any]] = mapped_column(JsonDocument, default=dict)
    before: Mapped[dict[str, Any] | None] = mapped_column(JsonDocument)
    after: Mapped[dict[str, Any] | None] = mapped_column(JsonDocument)
    status: Mapped[str] = mapped_column(String(16))
    error: Mapped[str | None] = mapped_column(Text)
    # The engine's scheduler step at which the change took effect.
    applied_at_step: Mapped[int | None] = mapped_column(BigInteger)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    execution: Mapped[Execution] = relationship(back_populates="steps")


class Incident(Base):
    """A rule finding on one engine, from first seen to resolved."""

    __tablename__ = "incidents"
    __table_args__ = (
        CheckConstraint(_in("state", INCIDENT_STATES), name="state"),
        CheckConstraint("(state = 'resolved') = (open_key IS NULL)", name="open_key_iff_open"),
        UniqueConstraint("open_key"),
        Index("ix_incidents_engine_alert", "engine", "alert"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    alert: Mapped[str] = mapped_column(String(128))
    engine: Mapped[str] = mapped_column(String(512))
    severity: Mapped[str] = mapped_column(String(16))
    state: Mapped[str] = mapped_column(String(16))
    value: Mapped[float | None] = mapped_column(Float)
    first_seen: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_seen: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    resolved_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    labels: Mapped[dict[str, str]] = mapped_column(JsonDocument, default=dict)
    # sha of (alert, engine) while open, NULL once resolved: at most one open
    # incident per (alert, engine), any number of resolved ones.
    open_key: Mapped[str | None] = mapped_column(String(64))


@event.listens_for(Incident, "before_insert")
@event.listens_for(Incident, "before_update")
def _sync_incident_open_key(_mapper: Any, _connection: Any, incident: Incident) -> None:
    # Derived at flush time so no caller can forget it.
    if incident.state not in INCIDENT_STATES:
        raise ValueError(f"incident state {incident.state!r} not in {INCIDENT_STATES}")
    incident.open_key = (
        None if incident.state == "resolved" else incident_open_key(incident.alert, incident.engine)
    )


class WebhookEvent(Base):
    """One Alertmanager delivery, stored before it is acknowledged.

    Kept for a while for whoever asks what Alertmanager sent, then pruned by
    the service (retention: age and total size; webhook_events.py)."""

    __tablename__ = "webhook_events"
    __table_args__ = (
        Index("ix_webhook_events_processed_id", "processed", "id"),
        # Pruning: by age (a range on received_at) and by total size (newest
        # first, summing payload_bytes) from this index alone.
        Index("ix_webhook_events_received_at_payload_bytes", "received_at", "payload_bytes"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    received_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    group_key: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16))
    payload: Mapped[dict[str, Any]] = mapped_column(JsonDocument)
    processed: Mapped[bool] = mapped_column(Boolean, default=False)
    # Bytes of the delivery's body as received: what the size cap sums.
    payload_bytes: Mapped[int] = mapped_column(Integer, default=0)


class ExecutionEvent(Base):
    """One event of an execution (awaiting approval, started, succeeded, ...),
    appended in the transaction that changed the execution (events.py).

    `id` is the feed's cursor: it only grows, and an event becomes visible
    only after every event with a smaller id is settled (committed or rolled
    back), so a reader that remembers the last id it read misses nothing.
    `key` is the event's identity for receivers: every message about this
    event carries it, so a receiver drops a duplicate delivery.
    """

    __tablename__ = "execution_events"
    __table_args__ = (
        UniqueConstraint("execution_id", "event"),
        UniqueConstraint("key"),
        # SQLite would reuse the largest rowid once deleted: never go back.
        {"sqlite_autoincrement": True},
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    execution_id: Mapped[int] = mapped_column(ForeignKey("executions.id", ondelete="CASCADE"))
    event: Mapped[str] = mapped_column(String(32))
    key: Mapped[str] = mapped_column(String(36))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Notification(Base):
    """One execution event for one receiver (notify.py): the outbox row that
    makes each event go out once across replicas, and the delivery's fate.

    A replica claims a queued row for `claim_expires_at` before sending it and
    renews the claim while it tries; a claim that lapses (its replica died)
    is taken by another replica. `claims` counts them: a row claimed more
    than once may have reached its receiver more than once (same `event_key`).
    """

    __tablename__ = "notifications"
    __table_args__ = (
        CheckConstraint(_in("status", NOTIFICATION_STATUSES), name="status"),
        UniqueConstraint("execution_id", "event", "receiver"),
        Index("ix_notifications_status", "status"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    execution_id: Mapped[int] = mapped_column(ForeignKey("executions.id", ondelete="CASCADE"))
    event: Mapped[str] = mapped_column(String(32))
    receiver: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # The event's key (execution_events.key), carried in every message.
    event_key: Mapped[str | None] = mapped_column(String(36))
    claimed_by: Mapped[str | None] = mapped_column(String(255))
    claim_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    claims: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))


class NotificationCursor(Base):
    """Per receiver: every event up to `event_id` has its outbox row. Shared
    by the replicas, so a restart goes on where the last feed stopped."""

    __tablename__ = "notification_cursors"

    receiver: Mapped[str] = mapped_column(String(64), primary_key=True)
    event_id: Mapped[int] = mapped_column(Integer)


class Lease(Base):
    """A named, expiring lock held by one replica (leader election)."""

    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    holder: Mapped[str] = mapped_column(String(255))
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)

"""The notifications outbox: one row per (event, receiver), and the feed it is filled from.

The feed is the events table (events.py), read in id order from a cursor
per receiver (`events_after`); `queue_notifications` turns a page of events
into outbox rows and moves the receivers' cursors past it, in one
transaction, so a feed that stops anywhere goes on where it left.

A row is queued until a replica claims it (`claim_notifications`: for a
lease, renewed while it tries, `renew_claims`) and records its fate
(`finish_notification`: delivered or failed). A claim that lapses — its
replica died, or hung past the lease — is claimed again by another replica:
delivery is at least once, and every message carries the event's key so a
receiver can drop the duplicate. The fate is visible (`runbook history ID`,
the page).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import Table, func, or_, select, update
from vllm_runbook.runbooks.store.base import StoreBase, iso
from vllm_runbook.runbooks.store.errors import StoreError
from vllm_runbook.runbooks.store.models import (
    NOTIFICATION_STATUSES,
    NOTIFY_QUEUED,
    ExecutionEvent,
    Notification,
    NotificationCursor,
    utcnow,
)


@dataclass(frozen=True, slots=True)
class NotificationRecord:
    id: int
    execution_id: int
    event: str
    receiver: str
    status: str
    attempts: int
    last_error: str | None
    created_at: datetime
    finished_at: datetime | None
    event_key: str | None = None
    claims: int = 0

    @classmethod
    def from_row(cls, row: Notification) -> NotificationRecord:
        return cls(
            id=row.id,
            execution_id=row.execution_id,
            event=row.event,
            receiver=row.receiver,
            status=row.status,
            attempts=row.attempts,
            last_error=row.last_error,
            created_at=row.created_at,
            finished_at=row.finished_at,
            event_key=row.event_key,
            claims=row.claims,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "execution_id": self.execution_id,
            "event": self.event,
            "key": self.event_key,
            "receiver": self.receiver,
            "status": self.status,
            "attempts": self.attempts,
            "claims": self.claims,
            "last_error": self.last_error,
            "created_at": iso(self.created_at),
            "finished_at": iso(self.finished_at),
        }


@dataclass(frozen=True, slots=True)
class EventRecord:
    """One event of the feed: its position (`id`), what and whose, and its key."""

    id: int
    execution_id: int
    event: str
    key: str
    created_at: datetime


@dataclass(frozen=True, slots=True)
class Claim:
    """A queued notification this replica now holds (until `expires_at`)."""

    id: int
    execution_id: int
    event: str
    receiver: str
    event_key: str | None
    expires_at: datetime


# Core statements on the outbox (several rows at once, RETURNING their columns).
_OUTBOX = cast(Table, Notification.__table__)


class NotificationStore(StoreBase):
    """The feed of execution events, and the outbox of deliveries to receivers."""

    # --- the feed ------------------------------------------------------------------

    def events_after(self, after_id: int, *, limit: int = 1000) -> list[EventRecord]:
        """Events with an id above `after_id`, in id order (the feed's next page).
        No event with a smaller id can appear later (events.py)."""
        query = (
            select(ExecutionEvent)
            .where(ExecutionEvent.id > after_id)
            .order_by(ExecutionEvent.id)
            .limit(limit)
        )
        with self.session() as s:
            return [
                EventRecord(r.id, r.execution_id, r.event, r.key, r.created_at)
                for r in s.scalars(query)
            ]

    def events_of_execution(self, execution_id: int) -> list[EventRecord]:
        """An execution's events, oldest first."""
        query = (
            select(ExecutionEvent)
            .where(ExecutionEvent.execution_id == execution_id)
            .order_by(ExecutionEvent.id)
        )
        with self.session() as s:
            return [
                EventRecord(r.id, r.execution_id, r.event, r.key, r.created_at)
                for r in s.scalars(query)
            ]

    def feed_cursors(self, receivers: Sequence[str], *, lookback: timedelta) -> dict[str, int]:
        """Where each receiver's feed stands: its stored cursor, or for a
        receiver never fed, the last event older than `lookback` (a new
        receiver gets the recent events, not the whole history)."""
        with self.session() as s:
            rows = s.execute(
                select(NotificationCursor.receiver, NotificationCursor.event_id).where(
                    NotificationCursor.receiver.in_(list(receivers))
                )
            )
            stored = {receiver: event_id for receiver, event_id in rows}
            if len(stored) < len(receivers):
                start = s.scalar(
                    select(func.max(ExecutionEvent.id)).where(
                        ExecutionEvent.created_at < utcnow() - lookback
                    )
                )
                for receiver in receivers:
                    stored.setdefault(receiver, start or 0)
        return stored

    def queue_notifications(
        self, events: Sequence[EventRecord], cursors: dict[str, int]
    ) -> dict[str, int]:
        """Outbox rows for the events past each receiver's cursor, and the
        receivers' cursors moved to the last event, in one transaction.
        Rows another replica queued already are kept as they are. Returns
        the rows this call created, per receiver."""
        if not events:
            return {}
        last = events[-1].id
        now = utcnow()
        created: dict[str, int] = {}
        with self.session(write=True) as s:
            for receiver, cursor in cursors.items():
                rows = [
                    {
                        "execution_id": e.execution_id,
                        "event": e.event,
                        "receiver": receiver,
                        "status": NOTIFY_QUEUED,
                        "attempts": 0,
                        "claims": 0,
                        "created_at": now,
                        "event_key": e.key,
                    }
                    for e in events
                    if e.id > cursor
                ]
                if rows:
                    stmt = (
                        self._insert()(_OUTBOX)
                        .on_conflict_do_nothing(
                            index_elements=["execution_id", "event", "receiver"]
                        )
                        .returning(_OUTBOX.c.id)
                    )
                    created[receiver] = len(list(s.execute(stmt, rows)))
                self._advance_cursor(s, receiver, last)
        return created

    def _advance_cursor(self, s: Any, receiver: str, event_id: int) -> None:
        moved = s.execute(
            update(NotificationCursor)
            .where(NotificationCursor.receiver == receiver, NotificationCursor.event_id < event_id)
            .values(event_id=event_id)
            .execution_options(synchronize_session=False)
        )
        if moved.rowcount == 0:
            s.execute(
                self._insert()(NotificationCursor)
                .values(receiver=receiver, event_id=event_id)
                .on_conflict_do_nothing(index_elements=["receiver"])
            )

    # --- claims and fates ----------------------------------------------------------

    def claim_notifications(
        self, receiver: str, holder: str, lease_seconds: float, *, limit: int = 16
    ) -> list[Claim]:
        """Take up to `limit` queued rows of `receiver` that nobody holds (never
        claimed, or their claim lapsed), oldest first, for `lease_seconds`."""
        now = utcnow()
        expires = now + timedelta(seconds=lease_seconds)
        claimable = (
            Notification.receiver == receiver,
            Notification.status == NOTIFY_QUEUED,
            or_(Notification.claim_expires_at.is_(None), Notification.claim_expires_at <= now),
        )
        # Looked for in a read first: an idle delivery thread asks every
        # second, and a write would take SQLite's lock each time.
        with self.session() as s:
            if s.scalar(select(Notification.id).where(*claimable).limit(1)) is None:
                return []
        free = (
            select(Notification.id)
            .where(*claimable)
            .order_by(Notification.id)
            .limit(limit)
            # PostgreSQL: replicas claiming at once take different rows (SQLite
            # has one writer at a time and renders no FOR UPDATE).
            .with_for_update(skip_locked=True)
        )
        table = _OUTBOX
        stmt = (
            update(table)
            .where(table.c.id.in_(free.scalar_subquery()))
            .values(claimed_by=holder, claim_expires_at=expires, claims=table.c.claims + 1)
            .returning(table.c.id, table.c.execution_id, table.c.event, table.c.event_key)
        )
        with self.session(write=True) as s:
            rows = s.execute(stmt).all()
        return sorted(
            (Claim(r.id, r.execution_id, r.event, receiver, r.event_key, expires) for r in rows),
            key=lambda c: c.id,
        )

    def renew_claims(self, ids: Iterable[int], holder: str, lease_seconds: float) -> set[int]:
        """Extend this holder's claims that are still queued and still its own;
        the ids it still holds (a claim that lapsed may have been taken)."""
        ids = list(ids)
        if not ids:
            return set()
        now = utcnow()
        table = _OUTBOX
        stmt = (
            update(table)
            .where(
                table.c.id.in_(ids),
                table.c.claimed_by == holder,
                table.c.status == NOTIFY_QUEUED,
                table.c.claim_expires_at > now,
            )
            .values(claim_expires_at=now + timedelta(seconds=lease_seconds))
            .returning(table.c.id)
        )
        with self.session(write=True) as s:
            return set(s.scalars(stmt))

    def release_claims(self, ids: Iterable[int], holder: str) -> int:
        """Give up this holder's claims on rows still queued (a replica that
        stops): another replica may claim them at once. Returns how many."""
        ids = list(ids)
        if not ids:
            return 0
        table = _OUTBOX
        stmt = (
            update(table)
            .where(
                table.c.id.in_(ids),
                table.c.claimed_by == holder,
                table.c.status == NOTIFY_QUEUED,
            )
            .values(claim_expires_at=utcnow())
            .returning(table.c.id)
        )
        with self.session(write=True) as s:
            return len(list(s.scalars(stmt)))

    def finish_notification(
        self,
        notification_id: int,
        status: str,
        attempts: int,
        error: str | None = None,
        *,
        holder: str | None = None,
    ) -> NotificationRecord | None:
        """Record a delivery's fate: delivered, or failed after `attempts` tries.
        With `holder`, only while that holder's claim stands: None when the
        row was claimed by another replica meanwhile (it records its own)."""
        if status not in NOTIFICATION_STATUSES:
            raise ValueError(f"notification status {status!r} not in {NOTIFICATION_STATUSES}")
        stmt = (
            update(Notification)
            .where(Notification.id == notification_id)
            .values(status=status, attempts=attempts, last_error=error, finished_at=utcnow())
            .returning(Notification)
            .execution_options(synchronize_session=False)
        )
        if holder is not None:
            stmt = stmt.where(
                Notification.claimed_by == holder, Notification.status == NOTIFY_QUEUED
            )
        with self.session(write=True) as s:
            row = s.scalars(stmt).one_or_none()
            if row is not None:
                return NotificationRecord.from_row(row)
            if holder is None or s.get(Notification, notification_id) is None:
                raise StoreError(f"no notification with id {notification_id}")
            return None

    def notifications(
        self, execution_ids: list[int] | None = None, *, status: str | None = None
    ) -> dict[int, list[NotificationRecord]]:
        """Notification rows by execution id (all executions when None), oldest first."""
        query = select(Notification).order_by(Notification.id)
        if execution_ids is not None:
            query = query.where(Notification.execution_id.in_(execution_ids))
        if status is not None:
            query = query.where(Notification.status == status)
        out: dict[int, list[NotificationRecord]] = defaultdict(list)
        with self.session() as s:
            for row in s.scalars(query):
                out[row.execution_id].append(NotificationRecord.from_row(row))
        return dict(out)

"""The notifications outbox: one row per (execution, event, receiver).

The row is inserted before the delivery is tried; its unique key makes each
event go to each receiver once, whatever the number of replicas watching the
journal (the one whose insert wins delivers). It then records the delivery's
fate, so failed deliveries are visible (`runbook history ID`, the page).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import selectinload
from vllm_runbook.runbooks.store.base import StoreBase, iso
from vllm_runbook.runbooks.store.errors import StoreError
from vllm_runbook.runbooks.store.executions import ExecutionRecord
from vllm_runbook.runbooks.store.models import (
    NOTIFICATION_STATUSES,
    NOTIFY_QUEUED,
    Execution,
    Notification,
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
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "execution_id": self.execution_id,
            "event": self.event,
            "receiver": self.receiver,
            "status": self.status,
            "attempts": self.attempts,
            "last_error": self.last_error,
            "created_at": iso(self.created_at),
            "finished_at": iso(self.finished_at),
        }


class NotificationStore(StoreBase):
    """The outbox of execution events for the configured receivers."""

    def claim_notification(self, execution_id: int, event: str, receiver: str) -> int | None:
        """Queue one event for one receiver; its id, or None when another
        process (replica) queued it already and so delivers it."""
        values = {
            "execution_id": execution_id,
            "event": event,
            "receiver": receiver,
            "status": NOTIFY_QUEUED,
            "attempts": 0,
            "created_at": utcnow(),
        }
        stmt = (
            self._insert()(Notification)
            .values(**values)
            .on_conflict_do_nothing(index_elements=["execution_id", "event", "receiver"])
            .returning(Notification.id)
        )
        with self.session(write=True) as s:
            new_id: int | None = s.execute(stmt).scalar_one_or_none()
            return new_id

    def finish_notification(
        self, notification_id: int, status: str, attempts: int, error: str | None = None
    ) -> NotificationRecord:
        """Record a delivery's fate: delivered, or failed after `attempts` tries."""
        if status not in NOTIFICATION_STATUSES:
            raise ValueError(f"notification status {status!r} not in {NOTIFICATION_STATUSES}")
        with self.session(write=True) as s:
            row = s.get(Notification, notification_id, with_for_update=True)
            if row is None:
                raise StoreError(f"no notification with id {notification_id}")
            row.status, row.attempts, row.last_error = status, attempts, error
            row.finished_at = utcnow()
            s.flush()
            return NotificationRecord.from_row(row)

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

    def executions_changed_since(
        self, since: datetime, *, limit: int = 200
    ) -> list[ExecutionRecord]:
        """Executions written at or after `since`, oldest change first (the
        notifier's feed: it derives each execution's events from its record)."""
        query = (
            select(Execution)
            .where(Execution.updated_at >= since)
            .options(selectinload(Execution.steps))
            .order_by(Execution.updated_at, Execution.id)
            .limit(limit)
        )
        with self.session() as s:
            return [ExecutionRecord.from_row(r) for r in s.scalars(query)]

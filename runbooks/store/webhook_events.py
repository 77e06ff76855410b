"""Stored Alertmanager deliveries (webhook_events): their writing and retention.

Every delivery is stored with its whole payload before it is answered (the
service's durability contract); nothing reads them back but a person asking
what Alertmanager sent. They are kept for `max_age` and up to `max_bytes` in
total (the newest first), and the service prunes the rest on a schedule.
Executions never point at a delivery, so pruning one loses no journal entry.

Deletes go in batches of their own short transactions: on SQLite a prune of
a large backlog must not hold the write lock that deliveries wait for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Final

from sqlalchemy import ColumnElement, and_, delete, func, or_, select
from vllm_runbook.runbooks.store.base import StoreBase
from vllm_runbook.runbooks.store.executions import NewExecution
from vllm_runbook.runbooks.store.models import WebhookEvent, utcnow

PRUNE_BATCH: Final = 500


@dataclass(frozen=True)
class Pruned:
    """What one prune deleted: deliveries past the age limit, then beyond the size cap."""

    by_age: int = 0
    by_size: int = 0

    @property
    def total(self) -> int:
        return self.by_age + self.by_size


@dataclass(frozen=True)
class NewDelivery:
    """One Alertmanager delivery to store, with the pending executions it asks for."""

    group_key: str
    status: str
    payload: dict[str, Any]
    payload_bytes: int = 0
    executions: Sequence[NewExecution] = field(default_factory=tuple)


@dataclass(frozen=True)
class StoredDelivery:
    """A stored delivery's row id, and per execution asked for: (its id, whether
    this delivery created it; False: the episode's row existed already)."""

    event_id: int
    executions: list[tuple[int, bool]]


class WebhookEventStore(StoreBase):
    """Deliveries kept, their total size, and pruning (the Journal writes them
    with their executions: Journal.record_deliveries)."""

    def webhook_events_size(self) -> tuple[int, int]:
        """(deliveries stored, their total payload bytes)."""
        with self.session() as s:
            count, total = s.execute(
                select(func.count(), func.coalesce(func.sum(WebhookEvent.payload_bytes), 0))
            ).one()
        return int(count), int(total)

    def prune_webhook_events(
        self,
        *,
        max_age_s: float | None,
        max_bytes: int | None,
        now: datetime | None = None,
        batch: int = PRUNE_BATCH,
    ) -> Pruned:
        """Delete the deliveries received more than `max_age_s` ago, then the
        oldest ones beyond `max_bytes` in total (None: no such limit)."""
        by_age = by_size = 0
        if max_age_s is not None:
            cutoff = (now or utcnow()) - timedelta(seconds=max_age_s)
            by_age = self._delete_batches(WebhookEvent.received_at < cutoff, batch)
        if max_bytes is not None:
            boundary = self._newest_beyond(max_bytes)
            if boundary is not None:
                at, id_ = boundary
                older = or_(
                    WebhookEvent.received_at < at,
                    and_(WebhookEvent.received_at == at, WebhookEvent.id <= id_),
                )
                by_size = self._delete_batches(older, batch)
        return Pruned(by_age, by_size)

    def _newest_beyond(self, max_bytes: int) -> tuple[datetime, int] | None:
        """(received_at, id) of the newest delivery that does not fit in `max_bytes`
        when the deliveries are counted newest first; None when all fit."""
        newest_first = (WebhookEvent.received_at.desc(), WebhookEvent.id.desc())
        running = (
            select(
                WebhookEvent.id,
                WebhookEvent.received_at,
                func.sum(WebhookEvent.payload_bytes).over(order_by=newest_first).label("total"),
            )
        ).subquery()
        query = (
            select(running.c.received_at, running.c.id)
            .where(running.c.total > max_bytes)
            .order_by(running.c.received_at.desc(), running.c.id.desc())
            .limit(1)
        )
        with self.session() as s:
            row = s.execute(query).first()
        return None if row is None else (row[0], int(row[1]))

    def _delete_batches(self, condition: ColumnElement[bool], batch: int) -> int:
        deleted = 0
        while True:
            ids = select(WebhookEvent.id).where(condition).order_by(WebhookEvent.id).limit(batch)
            with self.session(write=True) as s:
                # A subquery: both dialects take IN (SELECT ... LIMIT) here.
                done = s.execute(
                    delete(WebhookEvent)
                    .where(WebhookEvent.id.in_(ids.scalar_subquery()))
                    .execution_options(synchronize_session=False)
                )
                count = int(done.rowcount or 0)  # type: ignore[attr-defined]
            deleted += count
            if count < batch:
                return deleted

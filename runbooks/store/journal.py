"""The runbook journal: `Journal`, every table's methods over one database.

    store = Journal(url)            # url: explicit > $RUNBOOK_DB_URL > SQLite in the data dir
    record, created = store.create_execution("oom-pressure", engine, trigger="cli", who="me")

What it stores, one module each: executions and their steps, checks and
verification, and the guardrail queries on them (executions.py); leases
(leases.py); incidents (incidents.py); approvals (approvals.py); the
notifications outbox (notifications.py); Alertmanager's deliveries, written
with their executions in one transaction (`record_deliveries`), and their
retention (webhook_events.py). The engine, the sessions and the
dialect's insert are shared (base.py); which process wrote a row and whether
it still runs is liveness.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from sqlalchemy import Table, insert
from vllm_runbook.runbooks.store.approvals import ApprovalStore
from vllm_runbook.runbooks.store.executions import ExecutionRecord, ExecutionStore, StepRecord
from vllm_runbook.runbooks.store.incidents import IncidentRecord, IncidentStore
from vllm_runbook.runbooks.store.leases import LeaseStore
from vllm_runbook.runbooks.store.liveness import process_alive
from vllm_runbook.runbooks.store.models import WebhookEvent, utcnow
from vllm_runbook.runbooks.store.notifications import NotificationStore
from vllm_runbook.runbooks.store.webhook_events import (
    NewDelivery,
    StoredDelivery,
    WebhookEventStore,
)

__all__ = ["ExecutionRecord", "IncidentRecord", "Journal", "StepRecord", "process_alive"]


class Journal(
    ExecutionStore,
    LeaseStore,
    IncidentStore,
    ApprovalStore,
    NotificationStore,
    WebhookEventStore,
):
    """Durable journal of runbook executions (SQLite file or PostgreSQL)."""

    def record_deliveries(self, deliveries: Sequence[NewDelivery]) -> list[StoredDelivery]:
        """Every delivery and its pending executions in one transaction: one
        executemany statement for the deliveries and one for the executions
        (`create_executions`), whatever their number. Raises StoreUnavailable
        when nothing was stored; a retry is idempotent (the episode key)."""
        events = cast(Table, WebhookEvent.__table__)
        with self.session(write=True) as s:
            event_ids = list(
                s.execute(
                    insert(events).returning(events.c.id, sort_by_parameter_order=True),
                    [
                        {
                            "group_key": d.group_key,
                            "status": d.status,
                            "payload": d.payload,
                            "processed": True,  # events and executions commit together
                            "received_at": utcnow(),
                            "payload_bytes": d.payload_bytes,
                        }
                        for d in deliveries
                    ],
                ).scalars()
            )
            created = iter(self.create_executions(s, [e for d in deliveries for e in d.executions]))
            return [
                StoredDelivery(event_id, [next(created) for _ in d.executions])
                for d, event_id in zip(deliveries, event_ids, strict=True)
            ]

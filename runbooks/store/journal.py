"""The runbook journal: `Journal`, every table's methods over one database.

    store = Journal(url)            # url: explicit > $RUNBOOK_DB_URL > SQLite in the data dir
    record, created = store.create_execution("oom-pressure", engine, trigger="cli", who="me")

What it stores, one module each: executions and their steps, checks and
verification, and the guardrail queries on them (executions.py); leases
(leases.py); incidents (incidents.py); approvals (approvals.py); the
notifications outbox (notifications.py); the stored deliveries' retention
(webhook_events.py). The engine, the sessions and the
dialect's insert are shared (base.py); which process wrote a row and whether
it still runs is liveness.py.
"""

from __future__ import annotations

from vllm_runbook.runbooks.store.approvals import ApprovalStore
from vllm_runbook.runbooks.store.executions import ExecutionRecord, ExecutionStore, StepRecord
from vllm_runbook.runbooks.store.incidents import IncidentRecord, IncidentStore
from vllm_runbook.runbooks.store.leases import LeaseStore
from vllm_runbook.runbooks.store.liveness import process_alive
from vllm_runbook.runbooks.store.notifications import NotificationStore
from vllm_runbook.runbooks.store.webhook_events import WebhookEventStore

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

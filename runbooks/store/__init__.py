"""The runbook store: journal of executions, incidents, webhook events, leases.

from vllm_runbook.runbooks.store import Journal, upgrade
upgrade(url)                  # once, or on service start
store = Journal(url)            # url: explicit > $RUNBOOK_DB_URL > SQLite in the data dir

The only writer of the database: every row is written and read through the
Journal's methods, and no SQLAlchemy session leaves this package. It imports
nothing of the runbooks but model/ (the exit codes), and knows no engine,
web service or scheduler; the migrations (Alembic) live here too.
"""

from __future__ import annotations

from vllm_runbook.runbooks.store.database import (
    ENV_VAR,
    default_sqlite_path,
    display_url,
    resolve_url,
)
from vllm_runbook.runbooks.store.errors import (
    ExecutionNotFound,
    IllegalTransition,
    InvalidInput,
    SchemaMissing,
    StoreError,
    StoreUnavailable,
)
from vllm_runbook.runbooks.store.executions import NewExecution
from vllm_runbook.runbooks.store.journal import (
    ExecutionRecord,
    IncidentRecord,
    Journal,
    StepRecord,
)
from vllm_runbook.runbooks.store.liveness import process_alive, process_start
from vllm_runbook.runbooks.store.models import (
    ACTIVE_STATUSES,
    EXECUTION_STATUSES,
    EXECUTION_TRANSITIONS,
    FINAL_STATUSES,
    ApprovalState,
    Base,
    Execution,
    ExecutionStatus,
    Incident,
    Lease,
    Step,
    WebhookEvent,
    episode_key,
)
from vllm_runbook.runbooks.store.schema import (
    current_revision,
    ensure_schema,
    has_journal,
    head_revision,
    upgrade,
)

__all__ = [
    "ACTIVE_STATUSES",
    "ENV_VAR",
    "EXECUTION_STATUSES",
    "EXECUTION_TRANSITIONS",
    "FINAL_STATUSES",
    "ApprovalState",
    "Base",
    "Execution",
    "ExecutionNotFound",
    "ExecutionRecord",
    "ExecutionStatus",
    "IllegalTransition",
    "Incident",
    "IncidentRecord",
    "InvalidInput",
    "Journal",
    "Lease",
    "NewExecution",
    "SchemaMissing",
    "Step",
    "StepRecord",
    "StoreError",
    "StoreUnavailable",
    "WebhookEvent",
    "current_revision",
    "default_sqlite_path",
    "display_url",
    "ensure_schema",
    "episode_key",
    "has_journal",
    "head_revision",
    "process_alive",
    "process_start",
    "resolve_url",
    "upgrade",
]

"""Execution events and notification claims: the events table (the
notifier's feed, one row per event with its key, appended in the change's
transaction), the receivers' feed cursors, claims that expire on the
outbox rows, and partial indexes for what the worker runs and what awaits
approval.

Events already notified (outbox rows) get their event row and key, so the
new feed does not derive them again. Outbox rows still queued were claimed
by a replica that did not finish them: unclaimed now, another replica sends
them.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02 01:06:50.645455

"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

RUNNABLE = (
    "status = 'pending' AND \"trigger\" IN ('alert', 'rule') "
    "AND (reason IS NULL OR reason <> 'awaiting approval')"
)
AWAITING = "status = 'pending' AND reason = 'awaiting approval'"


def upgrade() -> None:
    op.create_table(
        "notification_cursors",
        sa.Column("receiver", sa.String(length=64), nullable=False),
        sa.Column("event_id", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("receiver", name=op.f("pk_notification_cursors")),
    )
    op.create_table(
        "execution_events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("execution_id", sa.Integer(), nullable=False),
        sa.Column("event", sa.String(length=32), nullable=False),
        sa.Column("key", sa.String(length=36), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["execution_id"],
            ["executions.id"],
            name=op.f("fk_execution_events_execution_id_executions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_execution_events")),
        sa.UniqueConstraint(
            "execution_id", "event", name=op.f("uq_execution_events_execution_id_event")
        ),
        sa.UniqueConstraint("key", name=op.f("uq_execution_events_key")),
        sqlite_autoincrement=True,
    )
    with op.batch_alter_table("executions", schema=None) as batch_op:
        batch_op.create_index(
            "ix_executions_awaiting",
            ["created_at"],
            unique=False,
            sqlite_where=sa.text(AWAITING),
            postgresql_where=sa.text(AWAITING),
        )
        batch_op.create_index(
            "ix_executions_runnable",
            ["id"],
            unique=False,
            sqlite_where=sa.text(RUNNABLE),
            postgresql_where=sa.text(RUNNABLE),
        )

    with op.batch_alter_table("notifications", schema=None) as batch_op:
        batch_op.add_column(sa.Column("event_key", sa.String(length=36), nullable=True))
        batch_op.add_column(sa.Column("claimed_by", sa.String(length=255), nullable=True))
        batch_op.add_column(sa.Column("claim_expires_at", sa.DateTime(), nullable=True))
        batch_op.add_column(
            sa.Column("claims", sa.Integer(), server_default=sa.text("0"), nullable=False)
        )
    _backfill_events()


def _backfill_events() -> None:
    """An event row and key for each event the old outbox holds."""
    bind = op.get_bind()
    notifications = sa.table(
        "notifications",
        sa.column("execution_id", sa.Integer()),
        sa.column("event", sa.String()),
        sa.column("created_at", sa.DateTime()),
        sa.column("event_key", sa.String()),
    )
    events = sa.table(
        "execution_events",
        sa.column("execution_id", sa.Integer()),
        sa.column("event", sa.String()),
        sa.column("key", sa.String()),
        sa.column("created_at", sa.DateTime()),
    )
    seen = bind.execute(
        sa.select(
            notifications.c.execution_id,
            notifications.c.event,
            sa.func.min(notifications.c.created_at),
        )
        .group_by(notifications.c.execution_id, notifications.c.event)
        .order_by(sa.func.min(notifications.c.created_at), notifications.c.execution_id)
    ).all()
    for execution_id, event, created_at in seen:
        key = str(uuid.uuid4())
        bind.execute(
            events.insert().values(
                execution_id=execution_id, event=event, key=key, created_at=created_at
            )
        )
        bind.execute(
            notifications.update()
            .where(notifications.c.execution_id == execution_id, notifications.c.event == event)
            .values(event_key=key)
        )


def downgrade() -> None:
    with op.batch_alter_table("notifications", schema=None) as batch_op:
        batch_op.drop_column("claims")
        batch_op.drop_column("claim_expires_at")
        batch_op.drop_column("claimed_by")
        batch_op.drop_column("event_key")

    with op.batch_alter_table("executions", schema=None) as batch_op:
        batch_op.drop_index("ix_executions_runnable")
        batch_op.drop_index("ix_executions_awaiting")

    op.drop_table("execution_events")
    op.drop_table("notification_cursors")

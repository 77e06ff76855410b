"""Approvals and notifications: who decided an execution awaiting approval,
when and why; the notifications outbox (one row per event and receiver).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 06:50:37.601091

"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "notifications",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("execution_id", sa.Integer(), nullable=False),
        sa.Column("event", sa.String(length=32), nullable=False),
        sa.Column("receiver", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.CheckConstraint(
            "status IN ('queued', 'delivered', 'failed')", name=op.f("ck_notifications_status")
        ),
        sa.ForeignKeyConstraint(
            ["execution_id"],
            ["executions.id"],
            name=op.f("fk_notifications_execution_id_executions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_notifications")),
        sa.UniqueConstraint(
            "execution_id",
            "event",
            "receiver",
            name=op.f("uq_notifications_execution_id_event_receiver"),
        ),
    )
    with op.batch_alter_table("notifications", schema=None) as batch_op:
        batch_op.create_index("ix_notifications_status", ["status"], unique=False)

    with op.batch_alter_table("executions", schema=None) as batch_op:
        batch_op.add_column(sa.Column("decision", sa.String(length=16), nullable=True))
        batch_op.add_column(sa.Column("decided_by", sa.String(length=256), nullable=True))
        batch_op.add_column(sa.Column("decided_at", sa.DateTime(), nullable=True))
        batch_op.add_column(sa.Column("decision_note", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("executions", schema=None) as batch_op:
        batch_op.drop_column("decision_note")
        batch_op.drop_column("decided_at")
        batch_op.drop_column("decided_by")
        batch_op.drop_column("decision")

    with op.batch_alter_table("notifications", schema=None) as batch_op:
        batch_op.drop_index("ix_notifications_status")

    op.drop_table("notifications")

"""Initial schema: executions, steps, incidents, webhook events, leases.

Revision ID: 0001
Revises:
Create Date: 2026-11-29 19:17:17.028542

"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "executions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("runbook", sa.String(length=64), nullable=False),
        sa.Column("engine", sa.String(length=512), nullable=False),
        sa.Column("trigger", sa.String(length=8), nullable=False),
        sa.Column("who", sa.String(length=256), nullable=False),
        sa.Column("alert_fingerprint", sa.String(length=64), nullable=True),
        sa.Column("alert_starts_at", sa.DateTime(), nullable=True),
        sa.Column("episode_key", sa.String(length=64), nullable=True),
        sa.Column("dry_run", sa.Boolean(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column(
            "checks", sa.JSON().with_variant(postgresql.JSONB(), "postgresql"), nullable=True
        ),
        sa.Column(
            "verification", sa.JSON().with_variant(postgresql.JSONB(), "postgresql"), nullable=True
        ),
        sa.Column("reverts_id", sa.Integer(), nullable=True),
        sa.Column("hostname", sa.String(length=255), nullable=True),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("pid_start", sa.BigInteger(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=True),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.CheckConstraint(
            "(trigger = 'alert') = (episode_key IS NOT NULL)",
            name=op.f("ck_executions_episode_key_iff_alert"),
        ),
        sa.CheckConstraint(
            "status IN ('pending', 'running', 'verifying', 'succeeded', 'failed', "
            "'rolled_back', 'reverted', 'refused')",
            name=op.f("ck_executions_status"),
        ),
        sa.CheckConstraint(
            "trigger IN ('cli', 'alert', 'rule')", name=op.f("ck_executions_trigger")
        ),
        sa.ForeignKeyConstraint(
            ["reverts_id"], ["executions.id"], name=op.f("fk_executions_reverts_id_executions")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_executions")),
        sa.UniqueConstraint("episode_key", name=op.f("uq_executions_episode_key")),
    )
    with op.batch_alter_table("executions", schema=None) as batch_op:
        batch_op.create_index("ix_executions_engine_id", ["engine", "id"], unique=False)
        batch_op.create_index(
            "ix_executions_runbook_engine_started",
            ["runbook", "engine", "started_at"],
            unique=False,
        )
        batch_op.create_index("ix_executions_status", ["status"], unique=False)

    op.create_table(
        "incidents",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("alert", sa.String(length=128), nullable=False),
        sa.Column("engine", sa.String(length=512), nullable=False),
        sa.Column("severity", sa.String(length=16), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("first_seen", sa.DateTime(), nullable=False),
        sa.Column("last_seen", sa.DateTime(), nullable=False),
        sa.Column("resolved_at", sa.DateTime(), nullable=True),
        sa.Column(
            "labels", sa.JSON().with_variant(postgresql.JSONB(), "postgresql"), nullable=False
        ),
        sa.Column("open_key", sa.String(length=64), nullable=True),
        sa.CheckConstraint(
            "(state = 'resolved') = (open_key IS NULL)", name=op.f("ck_incidents_open_key_iff_open")
        ),
        sa.CheckConstraint(
            "state IN ('pending', 'firing', 'resolved')", name=op.f("ck_incidents_state")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_incidents")),
        sa.UniqueConstraint("open_key", name=op.f("uq_incidents_open_key")),
    )
    with op.batch_alter_table("incidents", schema=None) as batch_op:
        batch_op.create_index("ix_incidents_engine_alert", ["engine", "alert"], unique=False)

    op.create_table(
        "leases",
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("holder", sa.String(length=255), nullable=False),
        sa.Column("expires_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_leases")),
    )
    op.create_table(
        "webhook_events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("received_at", sa.DateTime(), nullable=False),
        sa.Column("group_key", sa.Text(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column(
            "payload", sa.JSON().with_variant(postgresql.JSONB(), "postgresql"), nullable=False
        ),
        sa.Column("processed", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_webhook_events")),
    )
    with op.batch_alter_table("webhook_events", schema=None) as batch_op:
        batch_op.create_index("ix_webhook_events_processed_id", ["processed", "id"], unique=False)

    op.create_table(
        "steps",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("execution_id", sa.Integer(), nullable=False),
        sa.Column("ordinal", sa.Integer(), nullable=False),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column(
            "params", sa.JSON().with_variant(postgresql.JSONB(), "postgresql"), nullable=False
        ),
        sa.Column(
            "before", sa.JSON().with_variant(postgresql.JSONB(), "postgresql"), nullable=True
        ),
        sa.Column("after", sa.JSON().with_variant(postgresql.JSONB(), "postgresql"), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("applied_at_step", sa.BigInteger(), nullable=True),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.CheckConstraint(
            "status IN ('planned', 'skipped', 'applying', 'applied', 'failed', "
            "'interrupted', 'reverted')",
            name=op.f("ck_steps_status"),
        ),
        sa.ForeignKeyConstraint(
            ["execution_id"],
            ["executions.id"],
            name=op.f("fk_steps_execution_id_executions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_steps")),
        sa.UniqueConstraint("execution_id", "ordinal", name=op.f("uq_steps_execution_id_ordinal")),
    )
    with op.batch_alter_table("steps", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_steps_execution_id"), ["execution_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("steps", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_steps_execution_id"))

    op.drop_table("steps")
    with op.batch_alter_table("webhook_events", schema=None) as batch_op:
        batch_op.drop_index("ix_webhook_events_processed_id")

    op.drop_table("webhook_events")
    op.drop_table("leases")
    with op.batch_alter_table("incidents", schema=None) as batch_op:
        batch_op.drop_index("ix_incidents_engine_alert")

    op.drop_table("incidents")
    with op.batch_alter_table("executions", schema=None) as batch_op:
        batch_op.drop_index("ix_executions_status")
        batch_op.drop_index("ix_executions_runbook_engine_started")
        batch_op.drop_index("ix_executions_engine_id")

    op.drop_table("executions")

"""Retention of stored deliveries: each webhook event's size in bytes, and an
index for pruning by age and by total size.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-08 09:00:00.000000

"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("webhook_events", schema=None) as batch_op:
        batch_op.add_column(sa.Column("payload_bytes", sa.Integer(), nullable=True))
    # Deliveries stored before: the size of their stored JSON text.
    if op.get_bind().dialect.name == "postgresql":
        op.execute("UPDATE webhook_events SET payload_bytes = octet_length(payload::text)")
    else:
        op.execute("UPDATE webhook_events SET payload_bytes = length(CAST(payload AS BLOB))")
    with op.batch_alter_table("webhook_events", schema=None) as batch_op:
        batch_op.alter_column("payload_bytes", existing_type=sa.Integer(), nullable=False)
        batch_op.create_index(
            "ix_webhook_events_received_at_payload_bytes",
            ["received_at", "payload_bytes"],
            unique=False,
        )


def downgrade() -> None:
    with op.batch_alter_table("webhook_events", schema=None) as batch_op:
        batch_op.drop_index("ix_webhook_events_received_at_payload_bytes")
        batch_op.drop_column("payload_bytes")

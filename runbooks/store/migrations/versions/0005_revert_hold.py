"""The revert's hold: an execution whose alert resolved holds its changes
(`hold_since`, `hold_note`, `hold_for_person`) until the cause is gone; a
revert whose finding came back is marked `premature`.

Columns are added in place (no table copy): on SQLite a batch copy of
`executions` would drop it, and its steps and events would go with it.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-05 12:00:00.000000

"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COLUMNS = ("hold_since", "hold_note", "hold_for_person", "premature")


def upgrade() -> None:
    op.add_column("executions", sa.Column("hold_since", sa.DateTime(), nullable=True))
    op.add_column("executions", sa.Column("hold_note", sa.Text(), nullable=True))
    op.add_column(
        "executions",
        sa.Column("hold_for_person", sa.Boolean(), server_default=sa.false(), nullable=False),
    )
    op.add_column(
        "executions",
        sa.Column("premature", sa.Boolean(), server_default=sa.false(), nullable=False),
    )


def downgrade() -> None:
    # A holding execution's changes are still on the engine: it reads as
    # succeeded (or failed) again, as before this revision.
    for column in reversed(_COLUMNS):
        op.drop_column("executions", column)

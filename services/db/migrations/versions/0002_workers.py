"""Compiler workers and their heartbeats.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "workers",
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("fingerprint_keys", sa.JSON(), nullable=False),
        sa.Column("fingerprint", sa.JSON(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen", sa.DateTime(timezone=True), nullable=False),
        sa.Column("stopped", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_workers")),
    )
    op.create_index(op.f("ix_workers_last_seen"), "workers", ["last_seen"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_workers_last_seen"), table_name="workers")
    op.drop_table("workers")

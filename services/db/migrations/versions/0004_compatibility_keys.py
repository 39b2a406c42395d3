"""Compatibility keys: on artifacts (which nodes beyond the exact key can run them), on
workers (which portable engines they build) and on agents (which portable engines they run).

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("artifacts") as batch:
        batch.add_column(sa.Column("compatibility_key", sa.String(200), nullable=True))
        batch.create_index(
            batch.f("ix_artifacts_compatibility_key"), ["compatibility_key"], unique=False
        )
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("compatibility_keys", sa.JSON(), nullable=True))
    with op.batch_alter_table("agents") as batch:
        batch.add_column(sa.Column("compatibility_keys", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("agents") as batch:
        batch.drop_column("compatibility_keys")
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("compatibility_keys")
    with op.batch_alter_table("artifacts") as batch:
        batch.drop_index(batch.f("ix_artifacts_compatibility_key"))
        batch.drop_column("compatibility_key")

"""Tuning records: the candidate table per cache key, reused by a rebuild of the same key.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "tuning_records",
        sa.Column("model_id", sa.String(64), nullable=False),
        sa.Column("options_digest", sa.String(64), nullable=False),
        sa.Column("fingerprint_key", sa.String(200), nullable=False),
        sa.Column("toolchain", sa.String(200), nullable=False),
        sa.Column("winner", sa.String(200), nullable=True),
        sa.Column("winner_config", sa.JSON(), nullable=False),
        sa.Column("tuning_table", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["model_id"], ["models.id"],
                                name=op.f("fk_tuning_records_model_id_models")),
        sa.PrimaryKeyConstraint("model_id", "options_digest", "fingerprint_key", "toolchain",
                                name=op.f("pk_tuning_records")),
    )


def downgrade() -> None:
    op.drop_table("tuning_records")

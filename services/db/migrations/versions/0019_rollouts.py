"""Rollouts: a deployment change delivered in stages per fingerprint cohort, behind gates.

Revision ID: 0019
Revises: 0018
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "rollouts",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("deployment_id", sa.String(32), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("policy", sa.JSON, nullable=False),
        sa.Column("from_model_id", sa.String(64), nullable=False),
        sa.Column("from_options", sa.JSON, nullable=False),
        sa.Column("from_options_digest", sa.String(64), nullable=False),
        sa.Column("to_model_id", sa.String(64), nullable=False),
        sa.Column("to_options_digest", sa.String(64), nullable=False),
        sa.Column("cohorts", sa.JSON, nullable=False),
        sa.Column("reports", sa.JSON, nullable=False),
        sa.Column("reason", sa.String(1000), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["deployment_id"], ["deployments.id"], ondelete="CASCADE",
                                name=op.f("fk_rollouts_deployment_id_deployments")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rollouts")),
    )
    op.create_index(op.f("ix_rollouts_deployment_id"), "rollouts", ["deployment_id"])
    op.create_index(op.f("ix_rollouts_state"), "rollouts", ["state"])


def downgrade() -> None:
    op.drop_index(op.f("ix_rollouts_state"), table_name="rollouts")
    op.drop_index(op.f("ix_rollouts_deployment_id"), table_name="rollouts")
    op.drop_table("rollouts")

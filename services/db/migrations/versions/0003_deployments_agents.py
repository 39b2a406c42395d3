"""Deployments and runtime agents.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "deployments",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("model_id", sa.String(64), nullable=False),
        sa.Column("options", sa.JSON(), nullable=False),
        sa.Column("options_digest", sa.String(64), nullable=False),
        sa.Column("selector", sa.JSON(), nullable=False),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["model_id"], ["models.id"], name=op.f("fk_deployments_model_id_models")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_deployments")),
        sa.UniqueConstraint("name", name=op.f("uq_deployments_name")),
    )
    op.create_table(
        "agents",
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("labels", sa.JSON(), nullable=False),
        sa.Column("fingerprint", sa.JSON(), nullable=False),
        sa.Column("fingerprint_keys", sa.JSON(), nullable=False),
        sa.Column("serve_url", sa.String(1024), nullable=True),
        sa.Column("models", sa.JSON(), nullable=False),
        sa.Column("registered_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_agents")),
    )
    op.create_index(op.f("ix_agents_last_seen"), "agents", ["last_seen"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_agents_last_seen"), table_name="agents")
    op.drop_table("agents")
    op.drop_table("deployments")

"""An index on when artifacts were recorded: the API's re-check of desired-state changes asks
every second, while agents wait or their desired state is cached, which models got an engine
since its last look.

Revision ID: 0018
Revises: 0015
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0018"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(op.f("ix_artifacts_created_at"), "artifacts", ["created_at"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_artifacts_created_at"), table_name="artifacts")

"""An index on artifacts' state: the API's re-check of desired-state changes asks every
second, while agents wait or their desired state is cached, which artifacts are broken (an
artifact found broken changes the desired state of the agents that were handed it).

Revision ID: 0020
Revises: 0019
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(op.f("ix_artifacts_state"), "artifacts", ["state"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_artifacts_state"), table_name="artifacts")

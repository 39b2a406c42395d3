"""An index on when jobs finished: the API's re-check of desired-state changes asks every
second, while agents wait, which builds finished since its last look.

Revision ID: 0015
Revises: 0014
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(op.f("ix_compile_jobs_finished_at"), "compile_jobs", ["finished_at"],
                    unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_compile_jobs_finished_at"), table_name="compile_jobs")

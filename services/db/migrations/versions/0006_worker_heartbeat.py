"""Workers record their heartbeat interval: liveness is judged against each worker's own
cadence, so a job whose worker stopped beating can be detected and handed on.

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("heartbeat_s", sa.Float(), nullable=True))
    with op.batch_alter_table("compile_jobs") as batch:
        batch.create_index(batch.f("ix_compile_jobs_status"), ["status"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("compile_jobs") as batch:
        batch.drop_index(batch.f("ix_compile_jobs_status"))
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("heartbeat_s")

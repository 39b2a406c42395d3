"""Jobs finish or say why: worker instances (a restart under the same name is a new
instance), the instance owning a running job, when its task was enqueued, its deadline, and
when a failed build behind a deployment is retried.

Revision ID: 0014
Revises: 0013
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("instance", sa.String(64), nullable=True))
    with op.batch_alter_table("compile_jobs") as batch:
        batch.add_column(sa.Column("worker_instance", sa.String(64), nullable=True))
        batch.add_column(sa.Column("worker_pid", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("enqueued_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("deadline_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("retry_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("compile_jobs") as batch:
        batch.drop_column("retry_at")
        batch.drop_column("deadline_at")
        batch.drop_column("enqueued_at")
        batch.drop_column("worker_pid")
        batch.drop_column("worker_instance")
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("instance")

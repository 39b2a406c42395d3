"""Operations: an artifact can be ``broken`` (the store lost a part of it), a job can be
retried by an operator (each retry under its own task id) and forced to rebuild.

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("artifacts") as batch:
        batch.add_column(sa.Column("state", sa.String(16), nullable=False,
                                   server_default="ready"))
        batch.add_column(sa.Column("broken_reason", sa.Text(), nullable=True))
    with op.batch_alter_table("compile_jobs") as batch:
        batch.add_column(sa.Column("retries", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("force", sa.Boolean(), nullable=False,
                                   server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("compile_jobs") as batch:
        batch.drop_column("force")
        batch.drop_column("retries")
    with op.batch_alter_table("artifacts") as batch:
        batch.drop_column("broken_reason")
        batch.drop_column("state")

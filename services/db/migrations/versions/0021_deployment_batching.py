"""A deployment's dynamic-batching policy, carried to its agents in the desired state (NULL:
every request runs alone, as before).

Revision ID: 0021
Revises: 0020
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0021"
down_revision: str | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("deployments", sa.Column("batching", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column("deployments", "batching")

"""Models record their format: ONNX, or a torch.export archive.

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.add_column(sa.Column("format", sa.String(32), nullable=False,
                                   server_default="onnx"))


def downgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.drop_column("format")

"""Initial schema: models, artifacts, compile jobs.

Revision ID: 0001
Revises:
Create Date: 2024-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "models",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("name", sa.String(512), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("opset", sa.Integer(), nullable=False),
        sa.Column("ir_version", sa.Integer(), nullable=False),
        sa.Column("inputs", sa.JSON(), nullable=False),
        sa.Column("outputs", sa.JSON(), nullable=False),
        sa.Column("blob_key", sa.String(1024), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_models")),
    )
    op.create_table(
        "artifacts",
        sa.Column("id", sa.String(128), nullable=False),
        sa.Column("model_id", sa.String(64), nullable=False),
        sa.Column("options_digest", sa.String(64), nullable=False),
        sa.Column("fingerprint_key", sa.String(200), nullable=False),
        sa.Column("toolchain", sa.String(200), nullable=False),
        sa.Column("backend", sa.String(64), nullable=False),
        sa.Column("manifest", sa.JSON(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("max_abs_error", sa.Float(), nullable=False),
        sa.Column("p50_ms", sa.Float(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["model_id"], ["models.id"], name=op.f("fk_artifacts_model_id_models")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_artifacts")),
        sa.UniqueConstraint(
            "model_id",
            "options_digest",
            "fingerprint_key",
            "toolchain",
            name="uq_artifacts_cache_key",
        ),
    )
    op.create_index(
        op.f("ix_artifacts_fingerprint_key"), "artifacts", ["fingerprint_key"], unique=False
    )
    op.create_table(
        "compile_jobs",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("model_id", sa.String(64), nullable=False),
        sa.Column("options", sa.JSON(), nullable=False),
        sa.Column("options_digest", sa.String(64), nullable=False),
        sa.Column("fingerprint_key", sa.String(200), nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("stage", sa.String(32), nullable=False),
        sa.Column("progress", sa.Float(), nullable=False),
        sa.Column("error", sa.JSON(), nullable=True),
        sa.Column("artifact_id", sa.String(128), nullable=True),
        sa.Column("cache_hit", sa.Boolean(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("worker", sa.String(255), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["artifact_id"], ["artifacts.id"], name=op.f("fk_compile_jobs_artifact_id_artifacts")
        ),
        sa.ForeignKeyConstraint(
            ["model_id"], ["models.id"], name=op.f("fk_compile_jobs_model_id_models")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_compile_jobs")),
    )
    op.create_index(
        "ix_compile_jobs_cache_key",
        "compile_jobs",
        ["model_id", "options_digest", "fingerprint_key"],
        unique=False,
    )
    op.create_index(
        op.f("ix_compile_jobs_fingerprint_key"), "compile_jobs", ["fingerprint_key"], unique=False
    )
    op.create_index(
        op.f("ix_compile_jobs_options_digest"), "compile_jobs", ["options_digest"], unique=False
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_compile_jobs_options_digest"), table_name="compile_jobs")
    op.drop_index(op.f("ix_compile_jobs_fingerprint_key"), table_name="compile_jobs")
    op.drop_index("ix_compile_jobs_cache_key", table_name="compile_jobs")
    op.drop_table("compile_jobs")
    op.drop_index(op.f("ix_artifacts_fingerprint_key"), table_name="artifacts")
    op.drop_table("artifacts")
    op.drop_table("models")

"""The control plane's SQL tables (SQLAlchemy 2.x typed declarative).

Rows never leave ``services.db``: the repository functions in ``services.db.repo`` turn them
into ``schemas`` models. Types are portable (SQLite and PostgreSQL), and every timestamp is
tz-aware UTC when read back, on SQLite too. ``migrations/versions`` must match this module
exactly; ``tests/services/db/test_migrations.py`` checks that they never drift.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

#: Deterministic constraint names on every dialect (needed for SQLite batch migrations).
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

#: Column sizes, shared with the migrations.
SHA256_LEN = 64
JOB_ID_LEN = 32
ARTIFACT_ID_LEN = 128
FINGERPRINT_KEY_LEN = 200


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(sa.TypeDecorator[datetime]):
    """``DateTime(timezone=True)`` that refuses naive values and always reads back aware UTC.

    SQLite stores no offset, so values are normalized to UTC on the way in and tagged UTC on
    the way out; PostgreSQL's ``timestamptz`` is converted from the session time zone to UTC.
    """

    impl = sa.DateTime
    cache_ok = True

    def __init__(self) -> None:
        super().__init__(timezone=True)

    def process_bind_param(self, value: datetime | None, dialect: sa.Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(f"expected a tz-aware datetime, got naive {value.isoformat()}")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: sa.Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)


class ModelRow(Base):
    """A submitted model (ONNX or a torch.export archive), keyed by the sha256 of its bytes."""

    __tablename__ = "models"

    id: Mapped[str] = mapped_column(sa.String(SHA256_LEN), primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(512))
    size_bytes: Mapped[int] = mapped_column(sa.BigInteger)
    #: ``onnx`` or ``torch-export`` (``ModelInfo.format``).
    format: Mapped[str] = mapped_column(sa.String(32), default="onnx", server_default="onnx")
    opset: Mapped[int] = mapped_column(sa.Integer)
    ir_version: Mapped[int] = mapped_column(sa.Integer)
    inputs: Mapped[list[dict[str, Any]]] = mapped_column(sa.JSON)
    outputs: Mapped[list[dict[str, Any]]] = mapped_column(sa.JSON)
    blob_key: Mapped[str] = mapped_column(sa.String(1024))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class ArtifactRow(Base):
    """One engine for one cache key (model, options digest, fingerprint key, toolchain)."""

    __tablename__ = "artifacts"
    __table_args__ = (
        sa.UniqueConstraint(
            "model_id",
            "options_digest",
            "fingerprint_key",
            "toolchain",
            name="uq_artifacts_cache_key",
        ),
    )

    id: Mapped[str] = mapped_column(sa.String(ARTIFACT_ID_LEN), primary_key=True)
    model_id: Mapped[str] = mapped_column(sa.String(SHA256_LEN), sa.ForeignKey("models.id"))
    options_digest: Mapped[str] = mapped_column(sa.String(SHA256_LEN))
    fingerprint_key: Mapped[str] = mapped_column(sa.String(FINGERPRINT_KEY_LEN), index=True)
    #: ``ArtifactManifest.compatibility_key``: nodes with this key can run it too.
    compatibility_key: Mapped[str | None] = mapped_column(
        sa.String(FINGERPRINT_KEY_LEN), index=True
    )
    toolchain: Mapped[str] = mapped_column(sa.String(200))
    backend: Mapped[str] = mapped_column(sa.String(64))
    #: The signed manifest, ``ArtifactManifest.model_dump(mode="json")``.
    manifest: Mapped[dict[str, Any]] = mapped_column(sa.JSON)
    size_bytes: Mapped[int] = mapped_column(sa.BigInteger)
    max_abs_error: Mapped[float] = mapped_column(sa.Float)
    p50_ms: Mapped[float] = mapped_column(sa.Float)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, index=True)
    #: ``ready`` or ``broken`` (the store lost a part of it: never handed out, rebuilt).
    state: Mapped[str] = mapped_column(sa.String(16), default="ready", server_default="ready",
                                       index=True)
    broken_reason: Mapped[str | None] = mapped_column(sa.Text)


class CompileJobRow(Base):
    """One compile of one model with one set of options for one fingerprint key."""

    __tablename__ = "compile_jobs"
    __table_args__ = (
        sa.Index("ix_compile_jobs_cache_key", "model_id", "options_digest", "fingerprint_key"),
    )

    id: Mapped[str] = mapped_column(sa.String(JOB_ID_LEN), primary_key=True)
    model_id: Mapped[str] = mapped_column(sa.String(SHA256_LEN), sa.ForeignKey("models.id"))
    #: ``CompileOptions.model_dump(mode="json")``.
    options: Mapped[dict[str, Any]] = mapped_column(sa.JSON)
    options_digest: Mapped[str] = mapped_column(sa.String(SHA256_LEN), index=True)
    fingerprint_key: Mapped[str] = mapped_column(sa.String(FINGERPRINT_KEY_LEN), index=True)
    status: Mapped[str] = mapped_column(sa.String(32), index=True)
    stage: Mapped[str] = mapped_column(sa.String(32))
    progress: Mapped[float] = mapped_column(sa.Float)
    #: ``ErrorBody.model_dump(mode="json")``; SQL NULL (not JSON null) when there is none.
    error: Mapped[dict[str, Any] | None] = mapped_column(sa.JSON(none_as_null=True))
    artifact_id: Mapped[str | None] = mapped_column(
        sa.String(ARTIFACT_ID_LEN), sa.ForeignKey("artifacts.id")
    )
    cache_hit: Mapped[bool] = mapped_column(sa.Boolean, default=False)
    attempts: Mapped[int] = mapped_column(sa.Integer, default=0)
    #: Operator retries (``/retry``); the task id of each retry differs (``task_id``).
    retries: Mapped[int] = mapped_column(sa.Integer, default=0, server_default="0")
    #: A forced rebuild: the worker does not answer it from an existing artifact.
    force: Mapped[bool] = mapped_column(sa.Boolean, default=False, server_default=sa.false())
    worker: Mapped[str | None] = mapped_column(sa.String(255))
    #: The worker process (its instance id, new at every start) that runs the job: liveness
    #: is judged by instance, so a worker restarted under the same name never hides a dead
    #: predecessor's job.
    worker_instance: Mapped[str | None] = mapped_column(sa.String(64))
    #: The process of that instance building it (a pool child): a redelivery to the same
    #: instance takes over only when that process is gone.
    worker_pid: Mapped[int | None] = mapped_column(sa.Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), index=True)
    #: When its task was last sent to the broker (NULL: never, e.g. the API died between
    #: commit and enqueue); the sweep sends it again after a grace period.
    enqueued_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    #: A running job not finished by then is failed ``timed_out`` by the sweep (the task's
    #: hard time limit plus a grace).
    deadline_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    #: A failed build behind a deployment is retried (as a new job) from this time on.
    retry_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


class WorkerRow(Base):
    """A compiler worker and the fingerprint keys (queues) it serves; kept by its heartbeat."""

    __tablename__ = "workers"

    name: Mapped[str] = mapped_column(sa.String(255), primary_key=True)
    fingerprint_keys: Mapped[list[str]] = mapped_column(sa.JSON)
    #: Fingerprint key → compatibility key of the portable engines built there.
    compatibility_keys: Mapped[dict[str, str] | None] = mapped_column(sa.JSON)
    #: Fingerprint key → the model formats built there (``WorkerInfo.model_formats``).
    model_formats: Mapped[dict[str, list[str]] | None] = mapped_column(sa.JSON)
    #: Fingerprint key → the precisions built there (``WorkerInfo.precisions``).
    precisions: Mapped[dict[str, list[str]] | None] = mapped_column(sa.JSON)
    #: ``HardwareFingerprint.model_dump(mode="json")``.
    fingerprint: Mapped[dict[str, Any]] = mapped_column(sa.JSON)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    last_seen: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, index=True)
    stopped: Mapped[bool] = mapped_column(sa.Boolean, default=False)
    #: The worker's heartbeat interval, seconds: it is alive while beats keep to it.
    heartbeat_s: Mapped[float | None] = mapped_column(sa.Float)
    #: The process now beating under ``name`` (a uuid per start).
    instance: Mapped[str | None] = mapped_column(sa.String(64))


class DeploymentRow(Base):
    """A model (and options) assigned to the agents whose labels match ``selector``."""

    __tablename__ = "deployments"

    id: Mapped[str] = mapped_column(sa.String(JOB_ID_LEN), primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(64), unique=True)
    model_id: Mapped[str] = mapped_column(sa.String(SHA256_LEN), sa.ForeignKey("models.id"))
    options: Mapped[dict[str, Any]] = mapped_column(sa.JSON)
    options_digest: Mapped[str] = mapped_column(sa.String(SHA256_LEN))
    selector: Mapped[dict[str, str]] = mapped_column(sa.JSON)
    generation: Mapped[int] = mapped_column(sa.Integer, default=1)
    #: ``BatchingPolicy.model_dump(mode="json")``, or ``None``: no dynamic batching.
    batching: Mapped[dict[str, Any] | None] = mapped_column(sa.JSON, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class RolloutRow(Base):
    """A deployment change delivered in stages per fingerprint cohort (``schemas.rollouts``).
    At most one rollout of a deployment is active (running, paused or halted) at a time."""

    __tablename__ = "rollouts"

    id: Mapped[str] = mapped_column(sa.String(JOB_ID_LEN), primary_key=True)
    deployment_id: Mapped[str] = mapped_column(
        sa.String(JOB_ID_LEN), sa.ForeignKey("deployments.id", ondelete="CASCADE"), index=True)
    state: Mapped[str] = mapped_column(sa.String(16), index=True)
    #: ``RolloutPolicy.model_dump(mode="json")``.
    policy: Mapped[dict[str, Any]] = mapped_column(sa.JSON)
    from_model_id: Mapped[str] = mapped_column(sa.String(SHA256_LEN))
    from_options: Mapped[dict[str, Any]] = mapped_column(sa.JSON)
    from_options_digest: Mapped[str] = mapped_column(sa.String(SHA256_LEN))
    to_model_id: Mapped[str] = mapped_column(sa.String(SHA256_LEN))
    to_options_digest: Mapped[str] = mapped_column(sa.String(SHA256_LEN))
    #: Fingerprint key → cohort (stage, stage start, admitted agents, halt reason, ...).
    cohorts: Mapped[dict[str, Any]] = mapped_column(sa.JSON)
    #: Agent name → its last ``RolloutReport.model_dump(mode="json")``.
    reports: Mapped[dict[str, Any]] = mapped_column(sa.JSON)
    reason: Mapped[str | None] = mapped_column(sa.String(1000))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class AgentRow(Base):
    """A runtime agent: its labels, hardware, keys, and what it last reported serving."""

    __tablename__ = "agents"

    name: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    labels: Mapped[dict[str, str]] = mapped_column(sa.JSON)
    fingerprint: Mapped[dict[str, Any]] = mapped_column(sa.JSON)
    #: Backend name → fingerprint key.
    fingerprint_keys: Mapped[dict[str, str]] = mapped_column(sa.JSON)
    #: Backend name → the compatibility keys this node can also run.
    compatibility_keys: Mapped[dict[str, list[str]] | None] = mapped_column(sa.JSON)
    serve_url: Mapped[str | None] = mapped_column(sa.String(1024))
    #: ``[ModelStatus.model_dump(mode="json"), ...]`` from the last heartbeat.
    models: Mapped[list[dict[str, Any]]] = mapped_column(sa.JSON)
    registered_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    last_seen: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, index=True)
    #: ``TrustStatus.model_dump(mode="json")`` from the last heartbeat (stale, version, ...).
    trust: Mapped[dict[str, Any] | None] = mapped_column(sa.JSON)


class PluginRow(Base):
    """A custom-op plugin bundle version; the archive is a blob named by its digest."""

    __tablename__ = "plugins"
    __table_args__ = (sa.UniqueConstraint("name", "version", name="uq_plugins_name_version"),)

    digest: Mapped[str] = mapped_column(sa.String(SHA256_LEN), primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(64), index=True)
    version: Mapped[str] = mapped_column(sa.String(64))
    size_bytes: Mapped[int] = mapped_column(sa.BigInteger)
    #: ``domain::OpType`` of every op the plugin declares.
    ops: Mapped[list[str]] = mapped_column(sa.JSON)
    #: ``PluginManifest.model_dump(mode="json")``.
    manifest: Mapped[dict[str, Any]] = mapped_column(sa.JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class DatasetRow(Base):
    """An uploaded ``.npz`` of sample inputs, keyed by the sha256 of its bytes."""

    __tablename__ = "datasets"

    id: Mapped[str] = mapped_column(sa.String(SHA256_LEN), primary_key=True)
    blob_key: Mapped[str] = mapped_column(sa.String(1024))
    size_bytes: Mapped[int] = mapped_column(sa.BigInteger)
    #: ``[TensorSpec.model_dump(mode="json"), ...]``: name, dtype, shape (first axis: samples).
    tensors: Mapped[list[dict[str, Any]]] = mapped_column(sa.JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class TuningRecordRow(Base):
    """The tuner's candidate table for one cache key (model, options digest, fingerprint key,
    toolchain): exactly what invalidates it, so a new chip variant or toolchain tunes again."""

    __tablename__ = "tuning_records"

    model_id: Mapped[str] = mapped_column(
        sa.String(SHA256_LEN), sa.ForeignKey("models.id"), primary_key=True
    )
    options_digest: Mapped[str] = mapped_column(sa.String(SHA256_LEN), primary_key=True)
    fingerprint_key: Mapped[str] = mapped_column(sa.String(FINGERPRINT_KEY_LEN), primary_key=True)
    toolchain: Mapped[str] = mapped_column(sa.String(200), primary_key=True)
    #: The winning candidate's name; NULL when none passed.
    winner: Mapped[str | None] = mapped_column(sa.String(200))
    #: The winning candidate's backend settings (``CandidateResult.config``).
    winner_config: Mapped[dict[str, Any]] = mapped_column(sa.JSON)
    #: ``TuningTable.model_dump(mode="json")``.
    tuning_table: Mapped[dict[str, Any]] = mapped_column(sa.JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class RevokedTokenRow(Base):
    """An API token revoked before its expiry (``kiln token revoke``), by its ``jti``."""

    __tablename__ = "revoked_tokens"

    jti: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    revoked_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    #: The token's own expiry when known: after it the row is no longer needed.
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    #: Why it was revoked (free text from the admin).
    reason: Mapped[str] = mapped_column(sa.String(200), default="")

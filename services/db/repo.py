"""Repository functions: the only way the rest of Kiln reads and writes control-plane rows.

Every function takes the session first and keyword arguments after it, returns ``schemas``
models (never ORM rows), and flushes without committing: the caller owns the transaction
(``services.db.session_scope``). Inserts that may race (the same model uploaded twice, the
same artifact published by a redelivered task) run in a SAVEPOINT and fall back to reading
the row the other writer committed.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from schemas.agents import AgentInfo, AgentRegistration, ModelStatus
from schemas.deployments import Deployment, DeploymentCreate
from schemas.errors import Conflict, ErrorBody, ErrorCode, InvalidRequest, NotFound
from schemas.fingerprint import HardwareFingerprint
from schemas.jobs import CompileJob, JobStage, JobStatus
from schemas.manifest import ArtifactManifest, ArtifactSummary, TensorSpec
from schemas.models import ModelInfo
from schemas.options import CompileOptions
from schemas.plugins import PluginInfo, PluginManifest, PluginRef
from schemas.workers import WorkerInfo
from services.db.tables import (
    AgentRow,
    ArtifactRow,
    Base,
    CompileJobRow,
    DeploymentRow,
    ModelRow,
    PluginRow,
    WorkerRow,
    utcnow,
)

log = logging.getLogger(__name__)

ACTIVE_STATUSES = (JobStatus.QUEUED, JobStatus.RUNNING, JobStatus.WAITING_FOR_HARDWARE)
MAX_LIMIT = 1000
_SHA256 = re.compile(r"^[0-9a-f]{64}$")

RowT = TypeVar("RowT", bound=Base)


# --------------------------------------------------------------------------- helpers


def _check_limit(limit: int) -> None:
    if not 1 <= limit <= MAX_LIMIT:
        raise InvalidRequest(f"limit must be between 1 and {MAX_LIMIT}, got {limit}", limit=limit)


def _insert(session: Session, row: RowT, existing: Callable[[], RowT | None]) -> tuple[RowT, bool]:
    """Insert ``row`` in a SAVEPOINT; if a concurrent writer won, return its row instead."""
    try:
        with session.begin_nested():
            session.add(row)
    except IntegrityError:
        found = existing()
        if found is None:
            raise
        log.debug("lost an insert race on %s; using the committed row", type(row).__name__)
        return found, False
    return row, True


def _require_model(session: Session, model_id: str) -> ModelRow:
    row = session.get(ModelRow, model_id)
    if row is None:
        raise NotFound(f"no model {model_id}", model_id=model_id)
    return row


def _require_artifact(session: Session, artifact_id: str) -> ArtifactRow:
    row = session.get(ArtifactRow, artifact_id)
    if row is None:
        raise NotFound(f"no artifact {artifact_id}", artifact_id=artifact_id)
    return row


def _locked_job(session: Session, job_id: str) -> CompileJobRow:
    """The job row, re-read under ``SELECT ... FOR UPDATE`` (no-op on SQLite, which is
    serialized by ``BEGIN IMMEDIATE``)."""
    stmt = (
        sa.select(CompileJobRow)
        .where(CompileJobRow.id == job_id)
        .with_for_update()
        .execution_options(populate_existing=True)
    )
    row = session.scalars(stmt).one_or_none()
    if row is None:
        raise NotFound(f"no compile job {job_id}", job_id=job_id)
    return row


def _model_info(row: ModelRow) -> ModelInfo:
    return ModelInfo(
        id=row.id,
        name=row.name,
        sha256=row.id,
        size_bytes=row.size_bytes,
        opset=row.opset,
        ir_version=row.ir_version,
        inputs=[TensorSpec.model_validate(spec) for spec in row.inputs],
        outputs=[TensorSpec.model_validate(spec) for spec in row.outputs],
        created_at=row.created_at,
    )


def _job(row: CompileJobRow) -> CompileJob:
    return CompileJob(
        id=row.id,
        model_id=row.model_id,
        options=CompileOptions.model_validate(row.options),
        options_digest=row.options_digest,
        fingerprint_key=row.fingerprint_key,
        status=JobStatus(row.status),
        stage=JobStage(row.stage),
        progress=row.progress,
        error=ErrorBody.model_validate(row.error) if row.error is not None else None,
        artifact_id=row.artifact_id,
        cache_hit=row.cache_hit,
        attempts=row.attempts,
        worker=row.worker,
        created_at=row.created_at,
        updated_at=row.updated_at,
        started_at=row.started_at,
        finished_at=row.finished_at,
    )


def _artifact(row: ArtifactRow) -> ArtifactSummary:
    return ArtifactSummary(
        id=row.id,
        model_id=row.model_id,
        backend=row.backend,
        fingerprint_key=row.fingerprint_key,
        compatibility_key=row.compatibility_key,
        options_digest=row.options_digest,
        toolchain=row.toolchain,
        size_bytes=row.size_bytes,
        max_abs_error=row.max_abs_error,
        p50_ms=row.p50_ms,
        created_at=row.created_at,
    )


# --------------------------------------------------------------------------- models


def upsert_model(
    session: Session,
    *,
    sha256: str,
    name: str,
    size_bytes: int,
    opset: int,
    ir_version: int,
    inputs: list[TensorSpec],
    outputs: list[TensorSpec],
    blob_key: str,
) -> tuple[ModelInfo, bool]:
    """Record a model by the sha256 of its bytes: ``(model, created)``.

    The same bytes again (even from a concurrent upload) return the existing model with
    ``created=False``; its name and blob key are kept.
    """
    if not _SHA256.match(sha256):
        raise InvalidRequest(f"expected a lower-case sha256 hex digest, got {sha256!r}")
    row = session.get(ModelRow, sha256)
    if row is not None:
        return _model_info(row), False
    row, created = _insert(
        session,
        ModelRow(
            id=sha256,
            name=name,
            size_bytes=size_bytes,
            opset=opset,
            ir_version=ir_version,
            inputs=[spec.model_dump(mode="json") for spec in inputs],
            outputs=[spec.model_dump(mode="json") for spec in outputs],
            blob_key=blob_key,
            created_at=utcnow(),
        ),
        lambda: session.get(ModelRow, sha256),
    )
    if created:
        log.info("recorded model %s (%s, %d bytes)", sha256, name, size_bytes)
    return _model_info(row), created


def get_model(session: Session, *, model_id: str) -> ModelInfo:
    """The model ``model_id``; ``NotFound`` when there is none."""
    return _model_info(_require_model(session, model_id))


def get_model_blob_key(session: Session, *, model_id: str) -> str:
    """Where the model's bytes live in the artifact store; ``NotFound`` when unknown."""
    return _require_model(session, model_id).blob_key


def list_models(session: Session, *, limit: int = 100) -> list[ModelInfo]:
    """Models, newest first."""
    _check_limit(limit)
    stmt = sa.select(ModelRow).order_by(ModelRow.created_at.desc(), ModelRow.id).limit(limit)
    return [_model_info(row) for row in session.scalars(stmt)]


# --------------------------------------------------------------------------- jobs


def _new_job(model_id: str, options: CompileOptions, fingerprint_key: str) -> CompileJobRow:
    now = utcnow()
    return CompileJobRow(
        id=uuid.uuid4().hex,
        model_id=model_id,
        options=options.model_dump(mode="json"),
        options_digest=options.digest(),
        fingerprint_key=fingerprint_key,
        status=JobStatus.QUEUED.value,
        stage=JobStage.PENDING.value,
        progress=0.0,
        error=None,
        artifact_id=None,
        cache_hit=False,
        attempts=0,
        worker=None,
        created_at=now,
        updated_at=now,
    )


def create_job(
    session: Session, *, model_id: str, options: CompileOptions, fingerprint_key: str
) -> CompileJob:
    """A new job, ``queued`` at stage ``pending``. ``NotFound`` when the model is unknown."""
    _require_model(session, model_id)
    row = _new_job(model_id, options, fingerprint_key)
    session.add(row)
    session.flush()
    return _job(row)


def create_cached_job(
    session: Session,
    *,
    model_id: str,
    options: CompileOptions,
    fingerprint_key: str,
    artifact_id: str,
) -> CompileJob:
    """A job answered from an existing artifact: already ``succeeded``, ``cache_hit=True``."""
    _require_model(session, model_id)
    _require_artifact(session, artifact_id)
    row = _new_job(model_id, options, fingerprint_key)
    row.status = JobStatus.SUCCEEDED.value
    row.stage = JobStage.DONE.value
    row.progress = 1.0
    row.artifact_id = artifact_id
    row.cache_hit = True
    row.finished_at = row.created_at
    session.add(row)
    session.flush()
    return _job(row)


def get_job(session: Session, *, job_id: str) -> CompileJob:
    """The job ``job_id``; ``NotFound`` when there is none."""
    row = session.get(CompileJobRow, job_id)
    if row is None:
        raise NotFound(f"no compile job {job_id}", job_id=job_id)
    return _job(row)


def list_jobs(
    session: Session,
    *,
    model_id: str | None = None,
    status: JobStatus | None = None,
    limit: int = 100,
) -> list[CompileJob]:
    """Jobs, newest first, optionally only one model's or one status's."""
    _check_limit(limit)
    stmt = sa.select(CompileJobRow)
    if model_id is not None:
        stmt = stmt.where(CompileJobRow.model_id == model_id)
    if status is not None:
        stmt = stmt.where(CompileJobRow.status == JobStatus(status).value)
    stmt = stmt.order_by(CompileJobRow.created_at.desc(), CompileJobRow.id).limit(limit)
    return [_job(row) for row in session.scalars(stmt)]


def latest_job(
    session: Session,
    *,
    model_id: str,
    options_digest: str,
    fingerprint_key: str,
    statuses: tuple[JobStatus, ...] | None = None,
) -> CompileJob | None:
    """The newest job for this cache key (only among ``statuses`` when given), if any."""
    stmt = sa.select(CompileJobRow).where(
        CompileJobRow.model_id == model_id,
        CompileJobRow.options_digest == options_digest,
        CompileJobRow.fingerprint_key == fingerprint_key,
    )
    if statuses is not None:
        stmt = stmt.where(CompileJobRow.status.in_([s.value for s in statuses]))
    stmt = stmt.order_by(CompileJobRow.created_at.desc(), CompileJobRow.id).limit(1)
    row = session.scalars(stmt).first()
    return _job(row) if row is not None else None


def find_active_job(
    session: Session, *, model_id: str, options_digest: str, fingerprint_key: str
) -> CompileJob | None:
    """The newest queued, running or waiting job for this cache key, if any."""
    return latest_job(session, model_id=model_id, options_digest=options_digest,
                      fingerprint_key=fingerprint_key, statuses=ACTIVE_STATUSES)


def start_job(session: Session, *, job_id: str, worker: str) -> CompileJob | None:
    """Claim a job for ``worker``: any non-terminal status becomes ``running``.

    A redelivered task may find the job ``running`` (its first worker died); it takes it
    over. ``attempts`` grows by one, ``started_at`` is set, the stage starts again at
    ``pending``. Returns ``None`` when the job is already succeeded or failed: the caller
    then does nothing.
    """
    row = _locked_job(session, job_id)
    if JobStatus(row.status).terminal:
        log.info("job %s is already %s; %s leaves it alone", job_id, row.status, worker)
        return None
    if row.status == JobStatus.RUNNING.value:
        log.warning("job %s was running on %s; %s takes it over", job_id, row.worker, worker)
    now = utcnow()
    row.status = JobStatus.RUNNING.value
    row.stage = JobStage.PENDING.value
    row.progress = 0.0
    row.attempts += 1
    row.worker = worker
    row.started_at = now
    row.updated_at = now
    session.flush()
    return _job(row)


def set_job_stage(session: Session, *, job_id: str, stage: JobStage, progress: float) -> None:
    """Report pipeline progress (0..1). Ignored, with a warning, once the job is terminal."""
    if not 0.0 <= progress <= 1.0:
        raise InvalidRequest(f"progress must be between 0 and 1, got {progress}")
    row = _locked_job(session, job_id)
    if JobStatus(row.status).terminal:
        log.warning("job %s is %s; ignoring stage %s", job_id, row.status, stage)
        return
    row.stage = JobStage(stage).value
    row.progress = progress
    row.updated_at = utcnow()
    session.flush()


def set_job_status(session: Session, *, job_id: str, status: JobStatus) -> None:
    """Move a job between non-terminal statuses (e.g. ``waiting_for_hardware`` ↔ ``queued``).

    Ignored, with a warning, once the job is terminal; finishing a job goes through
    ``succeed_job`` or ``fail_job``, never here.
    """
    target = JobStatus(status)
    if target.terminal:
        raise InvalidRequest(
            f"set_job_status cannot set {target}; use succeed_job or fail_job", job_id=job_id
        )
    row = _locked_job(session, job_id)
    if JobStatus(row.status).terminal:
        log.warning("job %s is %s; ignoring status %s", job_id, row.status, target)
        return
    row.status = target.value
    row.updated_at = utcnow()
    session.flush()


def _finish(row: CompileJobRow, status: JobStatus) -> None:
    now = utcnow()
    row.status = status.value
    row.updated_at = now
    row.finished_at = now


def succeed_job(
    session: Session, *, job_id: str, artifact_id: str, cache_hit: bool = False
) -> CompileJob:
    """Mark a job succeeded with its artifact. Repeating it is a no-op; ``Conflict`` when the
    job already finished otherwise, ``NotFound`` when the job or artifact is unknown."""
    row = _locked_job(session, job_id)
    if row.status == JobStatus.SUCCEEDED.value and row.artifact_id == artifact_id:
        return _job(row)
    if JobStatus(row.status).terminal:
        raise Conflict(
            f"compile job {job_id} is already {row.status} (artifact {row.artifact_id}); "
            f"cannot mark it succeeded with artifact {artifact_id}",
            job_id=job_id,
        )
    _require_artifact(session, artifact_id)
    _finish(row, JobStatus.SUCCEEDED)
    row.stage = JobStage.DONE.value
    row.progress = 1.0
    row.artifact_id = artifact_id
    row.cache_hit = cache_hit
    row.error = None
    session.flush()
    return _job(row)


def fail_job(session: Session, *, job_id: str, error: ErrorBody) -> CompileJob:
    """Mark a job failed with a typed error; the stage it failed in is kept. A job that has
    already failed keeps its first error; ``Conflict`` when it already succeeded."""
    row = _locked_job(session, job_id)
    if row.status == JobStatus.FAILED.value:
        log.info("job %s had already failed; keeping its first error", job_id)
        return _job(row)
    if row.status == JobStatus.SUCCEEDED.value:
        raise Conflict(
            f"compile job {job_id} already succeeded (artifact {row.artifact_id}); cannot "
            f"mark it failed with {error.code}: {error.message}",
            job_id=job_id,
        )
    _finish(row, JobStatus.FAILED)
    row.error = error.model_dump(mode="json")
    session.flush()
    return _job(row)


# --------------------------------------------------------------------------- artifacts


def _artifact_by_key(
    session: Session, *, model_id: str, options_digest: str, fingerprint_key: str, toolchain: str
) -> ArtifactRow | None:
    stmt = sa.select(ArtifactRow).where(
        ArtifactRow.model_id == model_id,
        ArtifactRow.options_digest == options_digest,
        ArtifactRow.fingerprint_key == fingerprint_key,
        ArtifactRow.toolchain == toolchain,
    )
    return session.scalars(stmt).one_or_none()


def record_artifact(
    session: Session, *, model_id: str, manifest: ArtifactManifest
) -> tuple[ArtifactSummary, bool]:
    """Record a published artifact: ``(summary, created)``.

    Idempotent on the cache key (model, options digest, fingerprint key, toolchain): recording
    the same key again, even concurrently, returns the existing artifact with
    ``created=False``. ``Conflict`` when the artifact id is taken by a different key;
    ``InvalidRequest`` when the manifest is for another model; ``NotFound`` for an unknown
    model.
    """
    if manifest.model_sha256 != model_id:
        raise InvalidRequest(
            f"manifest {manifest.artifact_id} is for model {manifest.model_sha256}, not {model_id}",
            model_id=model_id,
        )
    key = {
        "model_id": model_id,
        "options_digest": manifest.options_digest,
        "fingerprint_key": manifest.fingerprint_key,
        "toolchain": manifest.toolchain,
    }

    def existing() -> ArtifactRow | None:
        row = _artifact_by_key(session, **key)
        if row is None and (other := session.get(ArtifactRow, manifest.artifact_id)):
            raise Conflict(
                f"artifact id {manifest.artifact_id} is already taken by model "
                f"{other.model_id}, options {other.options_digest}, fingerprint key "
                f"{other.fingerprint_key}, toolchain {other.toolchain}; not by {key}",
                artifact_id=manifest.artifact_id,
            )
        return row

    row = existing()
    if row is not None:
        return _artifact(row), False
    _require_model(session, model_id)
    row, created = _insert(
        session,
        ArtifactRow(
            id=manifest.artifact_id,
            backend=manifest.backend,
            compatibility_key=manifest.compatibility_key,
            manifest=manifest.model_dump(mode="json"),
            size_bytes=sum(blob.size for blob in manifest.blobs),
            max_abs_error=manifest.verification.max_abs_error,
            p50_ms=manifest.benchmark.p50_ms,
            created_at=utcnow(),
            **key,
        ),
        existing,
    )
    if created:
        log.info("recorded artifact %s for %s", manifest.artifact_id, key)
    return _artifact(row), created


def find_artifact(
    session: Session,
    *,
    model_id: str,
    options_digest: str,
    fingerprint_key: str,
    toolchain: str | None = None,
) -> ArtifactSummary | None:
    """The newest artifact for this model, options and fingerprint key — built by
    ``toolchain`` when given (the full cache key), else by any toolchain."""
    stmt = sa.select(ArtifactRow).where(
        ArtifactRow.model_id == model_id,
        ArtifactRow.options_digest == options_digest,
        ArtifactRow.fingerprint_key == fingerprint_key,
    )
    if toolchain is not None:
        stmt = stmt.where(ArtifactRow.toolchain == toolchain)
    stmt = stmt.order_by(ArtifactRow.created_at.desc(), ArtifactRow.id).limit(1)
    row = session.scalars(stmt).first()
    return _artifact(row) if row is not None else None


def find_compatible_artifact(
    session: Session,
    *,
    model_id: str,
    compatibility_keys: list[str],
    options_digest: str | None = None,
) -> ArtifactSummary | None:
    """The newest artifact of ``model_id`` whose compatibility key is one of
    ``compatibility_keys`` (built with ``options_digest`` when given, else with any options)."""
    if not compatibility_keys:
        return None
    stmt = sa.select(ArtifactRow).where(
        ArtifactRow.model_id == model_id,
        ArtifactRow.compatibility_key.in_(compatibility_keys),
    )
    if options_digest is not None:
        stmt = stmt.where(ArtifactRow.options_digest == options_digest)
    stmt = stmt.order_by(ArtifactRow.created_at.desc(), ArtifactRow.id).limit(1)
    row = session.scalars(stmt).first()
    return _artifact(row) if row is not None else None


def get_artifact(session: Session, *, artifact_id: str) -> ArtifactSummary:
    """The artifact ``artifact_id``; ``NotFound`` when there is none."""
    return _artifact(_require_artifact(session, artifact_id))


def get_manifest(session: Session, *, artifact_id: str) -> ArtifactManifest:
    """The signed manifest of ``artifact_id`` exactly as recorded; ``NotFound`` if unknown."""
    return ArtifactManifest.model_validate(_require_artifact(session, artifact_id).manifest)


def list_artifacts(
    session: Session,
    *,
    model_id: str | None = None,
    fingerprint_key: str | None = None,
    limit: int = 100,
) -> list[ArtifactSummary]:
    """Artifacts, newest first, optionally only one model's or one fingerprint key's."""
    _check_limit(limit)
    stmt = sa.select(ArtifactRow)
    if model_id is not None:
        stmt = stmt.where(ArtifactRow.model_id == model_id)
    if fingerprint_key is not None:
        stmt = stmt.where(ArtifactRow.fingerprint_key == fingerprint_key)
    stmt = stmt.order_by(ArtifactRow.created_at.desc(), ArtifactRow.id).limit(limit)
    return [_artifact(row) for row in session.scalars(stmt)]


# --------------------------------------------------------------------------- workers

#: A worker's heartbeat interval when it did not record one (``WorkerSettings``' default).
DEFAULT_WORKER_HEARTBEAT_S = 10.0
#: A worker is alive while its last heartbeat is younger than this many of its intervals,
#: plus ``WORKER_GRACE`` for clock skew and a slow database.
MISSED_BEATS = 3
WORKER_GRACE = timedelta(seconds=2)


def worker_ttl(heartbeat_s: float | None) -> timedelta:
    """How long after its last heartbeat a worker still counts as alive."""
    interval = timedelta(seconds=heartbeat_s or DEFAULT_WORKER_HEARTBEAT_S)
    return MISSED_BEATS * interval + WORKER_GRACE


def heartbeat_worker(
    session: Session,
    *,
    name: str,
    fingerprint_keys: list[str],
    fingerprint: HardwareFingerprint,
    portable_keys: dict[str, str] | None = None,
    heartbeat_s: float = DEFAULT_WORKER_HEARTBEAT_S,
    stopping: bool = False,
) -> WorkerInfo:
    """Record that worker ``name`` is alive (or, with ``stopping``, that it shut down) and
    beats every ``heartbeat_s`` seconds."""
    now = utcnow()
    row = session.get(WorkerRow, name, with_for_update=True)
    if row is None:
        row, _ = _insert(
            session,
            WorkerRow(name=name, fingerprint_keys=fingerprint_keys,
                      compatibility_keys=dict(portable_keys or {}),
                      fingerprint=fingerprint.model_dump(mode="json"), started_at=now,
                      last_seen=now, stopped=stopping),
            lambda: session.get(WorkerRow, name),
        )
    restarted = row.stopped and not stopping
    row.fingerprint_keys = fingerprint_keys
    row.compatibility_keys = dict(portable_keys or {})
    row.fingerprint = fingerprint.model_dump(mode="json")
    row.last_seen = now
    row.stopped = stopping
    row.heartbeat_s = heartbeat_s
    if restarted:
        row.started_at = now
    session.flush()
    if not stopping:
        release_waiting_jobs(session, fingerprint_keys=fingerprint_keys)
    return _worker(row)


def live_worker_keys(session: Session) -> set[str]:
    """The fingerprint keys that at least one live worker consumes."""
    return {key for worker in list_workers(session) if worker.alive
            for key in worker.fingerprint_keys}


def release_waiting_jobs(session: Session, *, fingerprint_keys: list[str]) -> int:
    """``waiting_for_hardware`` → ``queued`` for jobs on these keys (a worker serves them now).
    Returns how many jobs moved."""
    if not fingerprint_keys:
        return 0
    result = session.execute(
        sa.update(CompileJobRow)
        .where(
            CompileJobRow.status == JobStatus.WAITING_FOR_HARDWARE.value,
            CompileJobRow.fingerprint_key.in_(fingerprint_keys),
        )
        .values(status=JobStatus.QUEUED.value, updated_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    return result.rowcount or 0


def sweep_orphaned_jobs(
    session: Session, *, max_attempts: int
) -> tuple[list[CompileJob], list[CompileJob]]:
    """Hand on the running jobs whose worker stopped heartbeating (killed, crashed, host lost).

    A job with attempts left goes back to ``queued`` (``waiting_for_hardware`` when no live
    worker serves its key); the caller enqueues it again once this is committed. A job that
    has used ``max_attempts`` fails with ``worker_lost``: a model that takes down every worker
    building it must not go round forever. Returns ``(requeued, failed)``.
    """
    workers = {w.name: w for w in list_workers(session)}
    served = {key for w in workers.values() if w.alive for key in w.fingerprint_keys}
    stmt = (
        sa.select(CompileJobRow)
        .where(CompileJobRow.status == JobStatus.RUNNING.value)
        .order_by(CompileJobRow.created_at)
        .with_for_update(skip_locked=True)
    )
    requeued: list[CompileJob] = []
    failed: list[CompileJob] = []
    for row in session.scalars(stmt):
        worker = workers.get(row.worker or "")
        if worker is not None and worker.alive:
            continue
        lost = (f"worker {row.worker} stopped heartbeating while job {row.id} was at stage "
                f"{row.stage} (attempt {row.attempts} of {max_attempts})")
        if row.attempts >= max_attempts:
            _finish(row, JobStatus.FAILED)
            row.error = ErrorBody(code=ErrorCode.WORKER_LOST, message=f"{lost}; giving up",
                                  details={"worker": row.worker, "attempts": row.attempts}
                                  ).model_dump(mode="json")
            failed.append(row)
            log.error("%s; giving up", lost)
            continue
        waiting = row.fingerprint_key not in served
        row.status = (JobStatus.WAITING_FOR_HARDWARE if waiting else JobStatus.QUEUED).value
        row.stage = JobStage.PENDING.value
        row.progress = 0.0
        row.updated_at = utcnow()
        requeued.append(row)
        log.warning("%s; queued again", lost)
    session.flush()
    return [_job(r) for r in requeued], [_job(r) for r in failed]


def list_workers(session: Session) -> list[WorkerInfo]:
    """Every worker ever seen, most recently seen first, with ``alive`` computed now."""
    stmt = sa.select(WorkerRow).order_by(WorkerRow.last_seen.desc(), WorkerRow.name)
    return [_worker(row) for row in session.scalars(stmt)]


def _worker(row: WorkerRow) -> WorkerInfo:
    return WorkerInfo(
        name=row.name,
        fingerprint_keys=list(row.fingerprint_keys),
        portable_keys=dict(row.compatibility_keys or {}),
        fingerprint=HardwareFingerprint.model_validate(row.fingerprint),
        started_at=row.started_at,
        last_seen=row.last_seen,
        alive=not row.stopped and utcnow() - row.last_seen < worker_ttl(row.heartbeat_s),
    )


# --------------------------------------------------------------------------- deployments


def _deployment(row: DeploymentRow) -> Deployment:
    return Deployment(
        id=row.id,
        name=row.name,
        model_id=row.model_id,
        options=CompileOptions.model_validate(row.options),
        options_digest=row.options_digest,
        selector=dict(row.selector),
        generation=row.generation,
        created_at=row.created_at,
        updated_at=row.updated_at,
    )


def apply_deployment(session: Session, *, spec: DeploymentCreate) -> tuple[Deployment, bool]:
    """Create deployment ``spec.name``, or update it (its generation increases when the model,
    options or selector change). Returns (deployment, created). ``NotFound`` for an unknown
    model."""
    _require_model(session, spec.model_id)
    now = utcnow()
    options = spec.options.model_dump(mode="json")
    stmt = sa.select(DeploymentRow).where(DeploymentRow.name == spec.name).with_for_update()
    row = session.scalars(stmt).one_or_none()
    if row is None:
        row, created = _insert(
            session,
            DeploymentRow(id=uuid.uuid4().hex, name=spec.name, model_id=spec.model_id,
                          options=options, options_digest=spec.options.digest(),
                          selector=dict(spec.selector), generation=1, created_at=now,
                          updated_at=now),
            lambda: session.scalars(
                sa.select(DeploymentRow).where(DeploymentRow.name == spec.name)
            ).one_or_none(),
        )
        if created:
            return _deployment(row), True
    changed = (row.model_id, row.options_digest, row.selector) != (
        spec.model_id, spec.options.digest(), dict(spec.selector))
    if changed:
        row.model_id = spec.model_id
        row.options = options
        row.options_digest = spec.options.digest()
        row.selector = dict(spec.selector)
        row.generation += 1
        row.updated_at = now
        session.flush()
    return _deployment(row), False


def get_deployment(session: Session, *, name: str) -> Deployment:
    row = session.scalars(sa.select(DeploymentRow).where(DeploymentRow.name == name)).first()
    if row is None:
        raise NotFound(f"no deployment {name!r}", deployment=name)
    return _deployment(row)


def list_deployments(session: Session) -> list[Deployment]:
    stmt = sa.select(DeploymentRow).order_by(DeploymentRow.name)
    return [_deployment(row) for row in session.scalars(stmt)]


def delete_deployment(session: Session, *, name: str) -> None:
    row = session.scalars(sa.select(DeploymentRow).where(DeploymentRow.name == name)).first()
    if row is None:
        raise NotFound(f"no deployment {name!r}", deployment=name)
    session.delete(row)
    session.flush()


# --------------------------------------------------------------------------- agents

#: An agent whose last heartbeat is older than this is not alive.
AGENT_TTL = timedelta(seconds=60)


def _agent(row: AgentRow) -> AgentInfo:
    return AgentInfo(
        name=row.name,
        labels=dict(row.labels),
        fingerprint=HardwareFingerprint.model_validate(row.fingerprint),
        fingerprint_keys=dict(row.fingerprint_keys),
        compatibility_keys={k: list(v) for k, v in (row.compatibility_keys or {}).items()},
        serve_url=row.serve_url,
        registered_at=row.registered_at,
        last_seen=row.last_seen,
        alive=utcnow() - row.last_seen < AGENT_TTL,
        models=[ModelStatus.model_validate(m) for m in row.models],
    )


def register_agent(session: Session, *, registration: AgentRegistration) -> tuple[AgentInfo, bool]:
    """Record (or refresh, after a restart) an agent. Returns (agent, first time seen)."""
    now = utcnow()
    row = session.get(AgentRow, registration.name, with_for_update=True)
    fingerprint = registration.fingerprint.model_dump(mode="json")
    if row is None:
        row, created = _insert(
            session,
            AgentRow(name=registration.name, labels=dict(registration.labels),
                     fingerprint=fingerprint, fingerprint_keys=dict(registration.fingerprint_keys),
                     compatibility_keys=dict(registration.compatibility_keys),
                     serve_url=registration.serve_url, models=[], registered_at=now,
                     last_seen=now),
            lambda: session.get(AgentRow, registration.name),
        )
        if created:
            return _agent(row), True
    row.labels = dict(registration.labels)
    row.fingerprint = fingerprint
    row.fingerprint_keys = dict(registration.fingerprint_keys)
    row.compatibility_keys = dict(registration.compatibility_keys)
    row.serve_url = registration.serve_url
    row.registered_at = now
    row.last_seen = now
    session.flush()
    return _agent(row), False


def agent_heartbeat(session: Session, *, name: str, models: list[ModelStatus]) -> AgentInfo:
    """Record a heartbeat; ``NotFound`` when the agent never registered (it must register)."""
    row = session.get(AgentRow, name, with_for_update=True)
    if row is None:
        raise NotFound(f"no agent {name!r}; register with POST /v1/agents first", agent=name)
    row.models = [m.model_dump(mode="json") for m in models]
    row.last_seen = utcnow()
    session.flush()
    return _agent(row)


def get_agent(session: Session, *, name: str) -> AgentInfo:
    row = session.get(AgentRow, name)
    if row is None:
        raise NotFound(f"no agent {name!r}", agent=name)
    return _agent(row)


def list_agents(session: Session) -> list[AgentInfo]:
    stmt = sa.select(AgentRow).order_by(AgentRow.name)
    return [_agent(row) for row in session.scalars(stmt)]


def known_fingerprint_keys(session: Session) -> set[str]:
    """Every fingerprint key any agent has reported."""
    keys: set[str] = set()
    for mapping in session.scalars(sa.select(AgentRow.fingerprint_keys)):
        keys.update(mapping.values())
    return keys


# --------------------------------------------------------------------------- plugins


def _plugin(row: PluginRow) -> PluginInfo:
    return PluginInfo(name=row.name, version=row.version, digest=row.digest,
                      size_bytes=row.size_bytes, ops=list(row.ops),
                      manifest=PluginManifest.model_validate(row.manifest),
                      created_at=row.created_at)


def record_plugin(
    session: Session, *, manifest: PluginManifest, digest: str, size_bytes: int
) -> tuple[PluginInfo, bool]:
    """Record bundle ``digest`` as plugin ``manifest.name`` ``manifest.version``.

    The same bundle again returns the existing row (created=False). A version is immutable:
    another bundle under a recorded name and version raises ``Conflict``.
    """
    def existing() -> PluginRow | None:
        return session.scalars(sa.select(PluginRow).where(
            PluginRow.name == manifest.name, PluginRow.version == manifest.version)).first()

    found = existing()
    if found is None:
        found, created = _insert(session, PluginRow(
            digest=digest, name=manifest.name, version=manifest.version, size_bytes=size_bytes,
            ops=[op.qualified_name for op in manifest.ops],
            manifest=manifest.model_dump(mode="json"), created_at=utcnow(),
        ), lambda: session.get(PluginRow, digest) or existing())
        if created:
            return _plugin(found), True
    if found.digest != digest:
        raise Conflict(
            f"plugin {manifest.name} {manifest.version} is already registered with another "
            f"bundle (sha256 {found.digest}); versions are immutable, publish a new version",
            name=manifest.name, version=manifest.version, digest=found.digest,
        )
    return _plugin(found), False


def get_plugin(session: Session, *, name: str, version: str) -> PluginInfo:
    row = session.scalars(sa.select(PluginRow).where(
        PluginRow.name == name, PluginRow.version == version)).first()
    if row is None:
        versions = session.scalars(sa.select(PluginRow.version).where(PluginRow.name == name))
        raise NotFound(f"no plugin {name} {version}; registered versions of {name}: "
                       f"{sorted(versions)}", plugin=name, version=version)
    return _plugin(row)


def list_plugins(session: Session) -> list[PluginInfo]:
    stmt = sa.select(PluginRow).order_by(PluginRow.name, PluginRow.created_at.desc())
    return [_plugin(row) for row in session.scalars(stmt)]


def plugins_current(session: Session, *, artifact_id: str) -> bool:
    """Whether every plugin the artifact was built with is still the newest one providing its
    ops (a newer plugin version makes the artifact stale for new compile requests)."""
    # Asked for every deployment on every agent heartbeat: read the recorded refs only,
    # without validating the whole manifest.
    refs = _require_artifact(session, artifact_id).manifest.get("plugins") or []
    for ref in map(PluginRef.model_validate, refs):
        row = session.get(PluginRow, ref.digest)
        if row is None:
            return False
        newest = plugins_for_ops(session, ops=set(row.ops))
        if any(info.digest != ref.digest for info in newest.values()):
            return False
    return True


def plugins_for_ops(session: Session, *, ops: set[str]) -> dict[str, PluginInfo]:
    """For each ``domain::OpType`` in ``ops``, the newest plugin declaring it (ops no plugin
    declares are absent from the result)."""
    found: dict[str, PluginInfo] = {}
    stmt = sa.select(PluginRow).order_by(PluginRow.created_at.desc(), PluginRow.digest)
    for row in session.scalars(stmt):
        for op in set(row.ops) & ops:
            found.setdefault(op, _plugin(row))
    return found

"""Compile jobs: one model, one set of options, one fingerprint key; their status moves
``queued → running → succeeded | failed`` (or waits for hardware)."""

from __future__ import annotations

import logging
import uuid

import sqlalchemy as sa
from sqlalchemy.orm import Session

from schemas.errors import Conflict, ErrorBody, InvalidRequest, NotFound
from schemas.jobs import CompileJob, JobStage, JobStatus
from schemas.options import CompileOptions
from services.db.repo._common import _check_limit, _require_artifact, _require_model
from services.db.tables import CompileJobRow, utcnow

log = logging.getLogger(__name__)

ACTIVE_STATUSES = (JobStatus.QUEUED, JobStatus.RUNNING, JobStatus.WAITING_FOR_HARDWARE)

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

"""Row helpers the repository's job and worker modules share: a job row as its schema, a
job's finish, and whether a worker (instance) still heartbeats. Kept apart so that neither
module reaches into the other's private names."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy.orm import Session

from schemas.errors import ErrorBody
from schemas.jobs import CompileJob, JobStage, JobStatus
from schemas.options import CompileOptions
from services.db.tables import CompileJobRow, WorkerRow, utcnow

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


def worker_alive(row: WorkerRow) -> bool:
    return not row.stopped and utcnow() - row.last_seen < worker_ttl(row.heartbeat_s)


def instance_alive(session: Session, *, name: str | None, instance: str | None) -> bool:
    """Whether process ``instance`` still heartbeats under worker ``name``. A restart under
    the same name is another instance: the old one counts as dead. Without an instance
    (a row written before instances existed), the name alone decides."""
    row = session.get(WorkerRow, name or "")
    if row is None:
        return False
    if instance is not None and row.instance != instance:
        return False
    return worker_alive(row)


def job_from_row(row: CompileJobRow) -> CompileJob:
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
        retries=row.retries or 0,
        force=bool(row.force),
        worker=row.worker,
        worker_instance=row.worker_instance,
        worker_pid=row.worker_pid,
        created_at=row.created_at,
        updated_at=row.updated_at,
        started_at=row.started_at,
        finished_at=row.finished_at,
        enqueued_at=row.enqueued_at,
        deadline_at=row.deadline_at,
        retry_at=row.retry_at,
    )


def finish_row(row: CompileJobRow, status: JobStatus) -> None:
    now = utcnow()
    row.status = status.value
    row.updated_at = now
    row.finished_at = now

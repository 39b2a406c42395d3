"""Compiler workers: their heartbeats, liveness, and the jobs handed on when one is lost."""

from __future__ import annotations

import logging
from datetime import timedelta

import sqlalchemy as sa
from sqlalchemy.orm import Session

from schemas.errors import ErrorBody, ErrorCode
from schemas.fingerprint import HardwareFingerprint
from schemas.jobs import CompileJob, JobStage, JobStatus
from schemas.workers import WorkerInfo
from services.db.repo._common import _insert
from services.db.repo.jobs import _finish, _job
from services.db.tables import CompileJobRow, WorkerRow, utcnow

log = logging.getLogger(__name__)

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

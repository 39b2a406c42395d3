"""Compiler workers: their heartbeats, liveness, and the jobs handed on when one is lost."""

from __future__ import annotations

import functools
import logging
from datetime import timedelta

import sqlalchemy as sa
from sqlalchemy.orm import Session

from schemas.errors import ErrorBody, ErrorCode
from schemas.fingerprint import HardwareFingerprint
from schemas.jobs import CompileJob, JobStage, JobStatus
from schemas.workers import WorkerInfo
from services.db.repo._common import _insert
from services.db.repo._rows import (  # noqa: F401  (the liveness rules, as before)
    DEFAULT_WORKER_HEARTBEAT_S,
    MISSED_BEATS,
    WORKER_GRACE,
    finish_row,
    instance_alive,
    job_from_row,
    worker_alive,
    worker_ttl,
)
from services.db.tables import CompileJobRow, WorkerRow, utcnow

log = logging.getLogger(__name__)

def heartbeat_worker(
    session: Session,
    *,
    name: str,
    fingerprint_keys: list[str],
    fingerprint: HardwareFingerprint,
    portable_keys: dict[str, str] | None = None,
    model_formats: dict[str, list[str]] | None = None,
    precisions: dict[str, list[str]] | None = None,
    heartbeat_s: float = DEFAULT_WORKER_HEARTBEAT_S,
    stopping: bool = False,
    instance: str | None = None,
) -> WorkerInfo:
    """Record that worker ``name`` (process ``instance``) is alive (or, with ``stopping``,
    that it shut down) and beats every ``heartbeat_s`` seconds.

    A beat from another instance than the row's is a restart under the same name: the row
    now describes the new process, and the jobs the old one owned count as orphaned.
    A late shutdown beat from a replaced instance changes nothing."""
    now = utcnow()
    row = session.get(WorkerRow, name, with_for_update=True)
    if row is None:
        row, _ = _insert(
            session,
            WorkerRow(name=name, fingerprint_keys=fingerprint_keys,
                      compatibility_keys=dict(portable_keys or {}),
                      model_formats=dict(model_formats or {}),
                      precisions=dict(precisions or {}),
                      fingerprint=fingerprint.model_dump(mode="json"), started_at=now,
                      last_seen=now, stopped=stopping, instance=instance),
            lambda: session.get(WorkerRow, name),
        )
    if stopping and instance is not None and row.instance not in (None, instance):
        log.info("worker %s: ignoring the shutdown of replaced instance %s", name, instance)
        return _worker(row)
    restarted = (row.stopped and not stopping) or row.instance != instance
    if row.instance not in (None, instance):
        log.warning("worker %s restarted: instance %s replaces %s", name, instance,
                    row.instance)
    row.instance = instance
    row.fingerprint_keys = fingerprint_keys
    row.compatibility_keys = dict(portable_keys or {})
    row.model_formats = dict(model_formats or {})
    row.precisions = dict(precisions or {})
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


def live_workers(session: Session) -> tuple[set[str], dict[str, set[str]]]:
    """In one query of the few columns it needs: the fingerprint keys that at least one live
    worker consumes, and key → the model formats live workers build under it (keys whose
    workers say nothing about formats are left out)."""
    keys: set[str] = set()
    formats: dict[str, set[str]] = {}
    now = utcnow()
    rows = session.execute(_live_workers_statement())
    for fingerprint_keys, model_formats, last_seen, heartbeat_s in rows:
        if now - last_seen < worker_ttl(heartbeat_s):
            keys.update(fingerprint_keys)
            for key, names in (model_formats or {}).items():
                formats.setdefault(key, set()).update(names)
    return keys, formats


@functools.cache
def _live_workers_statement() -> sa.Select:
    table = WorkerRow.__table__
    return sa.select(table.c.fingerprint_keys, table.c.model_formats, table.c.last_seen,
                     table.c.heartbeat_s).where(sa.not_(table.c.stopped))


def live_worker_precisions(session: Session) -> dict[str, set[str]]:
    """Fingerprint key → the precisions live workers build under it (keys whose workers say
    nothing about precisions are left out)."""
    table = WorkerRow.__table__
    found: dict[str, set[str]] = {}
    now = utcnow()
    rows = session.execute(sa.select(table.c.precisions, table.c.last_seen, table.c.heartbeat_s)
                           .where(sa.not_(table.c.stopped)))
    for precisions, last_seen, heartbeat_s in rows:
        if now - last_seen < worker_ttl(heartbeat_s):
            for key, names in (precisions or {}).items():
                found.setdefault(key, set()).update(names)
    return found


def live_worker_keys(session: Session) -> set[str]:
    """The fingerprint keys that at least one live worker consumes."""
    return live_workers(session)[0]


def live_worker_formats(session: Session) -> dict[str, set[str]]:
    """Fingerprint key → the model formats live workers build under it (keys whose workers
    say nothing about formats are left out)."""
    return live_workers(session)[1]


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
    """Hand on the running jobs whose worker stopped heartbeating (killed, crashed, host lost,
    or restarted under the same name: liveness is judged by instance), and end those past
    their deadline.

    A job with attempts left goes back to ``queued`` (``waiting_for_hardware`` when no live
    worker serves its key); the caller enqueues it again once this is committed. A job that
    has used ``max_attempts`` fails with ``worker_lost``: a model that takes down every worker
    building it must not go round forever. A job past ``deadline_at`` (its task's hard time
    limit, which killed the build) fails ``timed_out`` with its stage.
    Returns ``(requeued, failed)``.
    """
    rows = {w.name: w for w in session.scalars(sa.select(WorkerRow))}
    served = {key for w in rows.values() if worker_alive(w) for key in w.fingerprint_keys}
    now = utcnow()
    stmt = (
        sa.select(CompileJobRow)
        .where(CompileJobRow.status == JobStatus.RUNNING.value)
        .order_by(CompileJobRow.created_at)
        .with_for_update(skip_locked=True)
    )
    requeued: list[CompileJob] = []
    failed: list[CompileJob] = []
    for row in session.scalars(stmt):
        if row.deadline_at is not None and now > row.deadline_at:
            message = (f"job {row.id} ran past its time limit (deadline "
                       f"{row.deadline_at.isoformat()}) at stage {row.stage} on {row.worker}")
            finish_row(row, JobStatus.FAILED)
            row.error = ErrorBody(code=ErrorCode.TIMED_OUT, message=message,
                                  details={"stage": row.stage, "worker": row.worker}
                                  ).model_dump(mode="json")
            failed.append(row)
            log.error("%s", message)
            continue
        if instance_alive(session, name=row.worker, instance=row.worker_instance):
            continue
        lost = (f"worker {row.worker} (instance {row.worker_instance}) stopped heartbeating "
                f"while job {row.id} was at stage {row.stage} (attempt {row.attempts} of "
                f"{max_attempts})")
        if row.attempts >= max_attempts:
            finish_row(row, JobStatus.FAILED)
            row.error = ErrorBody(code=ErrorCode.WORKER_LOST, message=f"{lost}; giving up",
                                  details={"worker": row.worker, "attempts": row.attempts,
                                           "stage": row.stage}).model_dump(mode="json")
            failed.append(row)
            log.error("%s; giving up", lost)
            continue
        waiting = row.fingerprint_key not in served
        row.status = (JobStatus.WAITING_FOR_HARDWARE if waiting else JobStatus.QUEUED).value
        row.stage = JobStage.PENDING.value
        row.progress = 0.0
        row.worker_instance = None
        row.worker_pid = None
        row.deadline_at = None
        row.updated_at = now
        requeued.append(row)
        log.warning("%s; queued again", lost)
    session.flush()
    return [job_from_row(r) for r in requeued], [job_from_row(r) for r in failed]


def list_workers(session: Session) -> list[WorkerInfo]:
    """Every worker ever seen, most recently seen first, with ``alive`` computed now."""
    stmt = sa.select(WorkerRow).order_by(WorkerRow.last_seen.desc(), WorkerRow.name)
    return [_worker(row) for row in session.scalars(stmt)]


def prune_workers(session: Session, *, gone_for: timedelta) -> list[str]:
    """Forget the workers (stopped or lost) whose last heartbeat is older than ``gone_for``;
    returns their names. A live worker is never pruned, however its clock drifts."""
    cutoff = utcnow() - gone_for
    pruned = []
    for row in session.scalars(sa.select(WorkerRow).where(WorkerRow.last_seen < cutoff)
                               .with_for_update(skip_locked=True)):
        if _worker(row).alive:
            continue
        pruned.append(row.name)
        session.delete(row)
    session.flush()
    if pruned:
        log.info("pruned workers gone for over %s: %s", gone_for, pruned)
    return pruned


def _worker(row: WorkerRow) -> WorkerInfo:
    alive = worker_alive(row)
    return WorkerInfo(
        name=row.name,
        instance=row.instance,
        fingerprint_keys=list(row.fingerprint_keys),
        portable_keys=dict(row.compatibility_keys or {}),
        model_formats={k: list(v) for k, v in (row.model_formats or {}).items()},
        precisions={k: list(v) for k, v in (row.precisions or {}).items()},
        fingerprint=HardwareFingerprint.model_validate(row.fingerprint),
        started_at=row.started_at,
        last_seen=row.last_seen,
        alive=alive,
        state="alive" if alive else "stopped" if row.stopped else "lost",
        heartbeat_s=row.heartbeat_s,
    )

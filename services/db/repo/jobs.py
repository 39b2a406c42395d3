"""Compile jobs: one model, one set of options, one fingerprint key; their status moves
``queued → running → succeeded | failed`` (or waits for hardware)."""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.orm import Session

from schemas.errors import (
    Conflict,
    ErrorBody,
    ErrorCode,
    InvalidRequest,
    JobCancelled,
    NotFound,
)
from schemas.jobs import CompileJob, JobStage, JobStatus
from schemas.options import CompileOptions
from services.db.repo._common import _check_limit, _require_artifact, _require_model
from services.db.repo._rows import finish_row, instance_alive, job_from_row
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


def _new_job(model_id: str, options: CompileOptions, fingerprint_key: str, *,
             force: bool = False) -> CompileJobRow:
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
        retries=0,
        force=force,
        worker=None,
        created_at=now,
        updated_at=now,
    )


def create_job(
    session: Session, *, model_id: str, options: CompileOptions, fingerprint_key: str,
    force: bool = False,
) -> CompileJob:
    """A new job, ``queued`` at stage ``pending``. ``NotFound`` when the model is unknown.
    With ``force`` the worker builds even when an artifact for the key exists (a rebuild)."""
    _require_model(session, model_id)
    row = _new_job(model_id, options, fingerprint_key, force=force)
    session.add(row)
    session.flush()
    return job_from_row(row)


def create_cached_job(
    session: Session,
    *,
    model_id: str,
    options: CompileOptions,
    fingerprint_key: str,
    artifact_id: str,
    read: bool = False,
    options_digest: str | None = None,
) -> CompileJob:
    """A job answered from an existing artifact: already ``succeeded``, ``cache_hit=True``.
    ``read``: the caller read the model and the artifact in this transaction, so they are not
    looked up again (the foreign keys still hold). ``options_digest``: ``options.digest()``
    when the caller has it already."""
    if not read:
        _require_model(session, model_id)
        _require_artifact(session, artifact_id)
    now = utcnow()
    job = CompileJob(
        id=uuid.uuid4().hex, model_id=model_id, options=options,
        options_digest=options_digest or options.digest(), fingerprint_key=fingerprint_key,
        status=JobStatus.SUCCEEDED, stage=JobStage.DONE, progress=1.0, error=None,
        artifact_id=artifact_id, cache_hit=True, attempts=0, retries=0, force=False,
        worker=None, created_at=now, updated_at=now, finished_at=now,
    )
    # One INSERT of plain values: no unit of work, no mapped object, and the options already
    # validated are not validated again (a cached answer is the busiest write of a farm whose
    # models are built: 200 a second in bench/scale.py).
    columns = _job_columns()
    session.execute(_insert_job(), {
        columns[key]: value for key, value in (
            ("id", job.id), ("model_id", model_id),
            ("options", options.model_dump(mode="json")),
            ("options_digest", job.options_digest), ("fingerprint_key", fingerprint_key),
            ("status", JobStatus.SUCCEEDED.value), ("stage", JobStage.DONE.value),
            ("progress", 1.0), ("error", None), ("artifact_id", artifact_id),
            ("cache_hit", True), ("attempts", 0), ("retries", 0), ("force", False),
            ("worker", None), ("created_at", now), ("updated_at", now), ("finished_at", now),
        )})
    return job


@functools.cache
def _insert_job() -> sa.Insert:
    return sa.insert(CompileJobRow.__table__)


@functools.cache
def _job_columns() -> dict[str, str]:
    """Mapped attribute name → column key of the jobs table."""
    return {attr.key: attr.columns[0].key
            for attr in sa.inspect(CompileJobRow).column_attrs}


def lock_job(session: Session, *, job_id: str) -> CompileJob:
    """The job, read under a row lock held until the caller commits or rolls back: a cancel
    waits for whatever the caller decides from it (the publication of a build)."""
    return job_from_row(_locked_job(session, job_id))


def get_job(session: Session, *, job_id: str) -> CompileJob:
    """The job ``job_id``; ``NotFound`` when there is none."""
    row = session.get(CompileJobRow, job_id)
    if row is None:
        raise NotFound(f"no compile job {job_id}", job_id=job_id)
    return job_from_row(row)


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
    return [job_from_row(row) for row in session.scalars(stmt)]


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
    return job_from_row(row) if row is not None else None


def latest_jobs(
    session: Session, *, model_id: str, options_digest: str, fingerprint_keys: list[str],
) -> dict[str, CompileJob]:
    """``latest_job`` for several fingerprint keys in one query: key → its newest job (keys
    without one are absent)."""
    if not fingerprint_keys:
        return {}
    stmt = sa.select(CompileJobRow).where(
        CompileJobRow.model_id == model_id,
        CompileJobRow.options_digest == options_digest,
        CompileJobRow.fingerprint_key.in_(sorted(set(fingerprint_keys))),
    ).order_by(CompileJobRow.created_at.desc(), CompileJobRow.id)
    found: dict[str, CompileJob] = {}
    for row in session.scalars(stmt):
        if row.fingerprint_key not in found:
            found[row.fingerprint_key] = job_from_row(row)
    return found


def find_active_job(
    session: Session, *, model_id: str, options_digest: str, fingerprint_key: str
) -> CompileJob | None:
    """The newest queued, running or waiting job for this cache key, if any."""
    return latest_job(session, model_id=model_id, options_digest=options_digest,
                      fingerprint_key=fingerprint_key, statuses=ACTIVE_STATUSES)


def start_job(
    session: Session,
    *,
    job_id: str,
    worker: str,
    instance: str | None = None,
    pid: int | None = None,
    max_attempts: int | None = None,
    count_attempt: bool = True,
    deadline: datetime | None = None,
    redelivered: bool = True,
    pid_alive: Callable[[int], bool] | None = None,
) -> CompileJob | None:
    """Claim a job for ``worker`` (process ``pid`` of its ``instance``): any non-terminal
    status becomes ``running``. Returns ``None`` when the caller must not build:

    - the job is already succeeded or failed;
    - it is running on an owner that is still alive and this is a fresh delivery, not a
      redelivery (``redelivered=False``): a second message for the same job (the sweep
      enqueued it again) yields one build. The owner is alive when its instance still
      heartbeats under its name and, for the caller's own instance, its process lives
      (``pid_alive``);
    - ``count_attempt`` and the job has already been started ``max_attempts`` times: it
      fails ``worker_lost`` (a model that takes down every worker building it, or a pool
      child killed again and again, must not go round forever).

    Otherwise the owner (``worker``, ``instance``, ``pid``), ``started_at``, the ``deadline``
    and the stage (``pending``) are set; ``attempts`` grows by one when ``count_attempt`` (a
    build starts; a publish resumed from kept outputs is no new build).
    """
    row = _locked_job(session, job_id)
    if JobStatus(row.status).terminal:
        log.info("job %s is already %s; %s leaves it alone", job_id, row.status, worker)
        return None
    if row.status == JobStatus.RUNNING.value:
        if not redelivered and row.worker_instance is not None:
            if row.worker_instance == instance:
                owner_alive = (row.worker_pid is not None and row.worker_pid != pid
                               and pid_alive is not None and pid_alive(row.worker_pid))
            else:
                owner_alive = instance_alive(session, name=row.worker,
                                             instance=row.worker_instance)
            if owner_alive:
                log.info("job %s is running on %s (%s, pid %s), which is alive; this "
                         "delivery is a duplicate", job_id, row.worker, row.worker_instance,
                         row.worker_pid)
                return None
        log.warning("job %s was running on %s (%s); %s takes it over", job_id, row.worker,
                    row.worker_instance, worker)
    now = utcnow()
    if count_attempt and max_attempts is not None and row.attempts >= max_attempts:
        message = (f"job {job_id} was started {row.attempts} times, the limit "
                   f"(KILN_MAX_JOB_ATTEMPTS) is {max_attempts}; its last attempt ended at "
                   f"stage {row.stage} on {row.worker}; giving up")
        log.error("%s", message)
        finish_row(row, JobStatus.FAILED)
        row.error = ErrorBody(code=ErrorCode.WORKER_LOST, message=message,
                              details={"worker": row.worker, "attempts": row.attempts,
                                       "stage": row.stage}).model_dump(mode="json")
        session.flush()
        return None
    row.status = JobStatus.RUNNING.value
    row.stage = JobStage.PENDING.value
    row.progress = 0.0
    if count_attempt:
        row.attempts += 1
    row.worker = worker
    row.worker_instance = instance
    row.worker_pid = pid
    row.deadline_at = deadline
    row.started_at = now
    row.updated_at = now
    session.flush()
    return job_from_row(row)


def schedule_build_retry(session: Session, *, job_id: str, base_s: float,
                         max_s: float) -> datetime | None:
    """When a failed build (behind a deployment) may be tried again as a new job: its
    finish time plus ``base_s`` doubled for each failed job of the same cache key in a row
    (since its last success), at most ``max_s``. Recorded on the job (``retry_at``, shown
    by the API). ``None`` when the job did not fail, or an operator cancelled it."""
    row = _locked_job(session, job_id)
    if row.status != JobStatus.FAILED.value or row.finished_at is None:
        return None
    if (row.error or {}).get("code") == ErrorCode.CANCELLED.value:
        return None
    last_success = session.scalar(
        sa.select(sa.func.max(CompileJobRow.created_at)).where(
            CompileJobRow.model_id == row.model_id,
            CompileJobRow.options_digest == row.options_digest,
            CompileJobRow.fingerprint_key == row.fingerprint_key,
            CompileJobRow.status == JobStatus.SUCCEEDED.value))
    in_a_row = session.scalar(
        sa.select(sa.func.count()).select_from(CompileJobRow).where(
            CompileJobRow.model_id == row.model_id,
            CompileJobRow.options_digest == row.options_digest,
            CompileJobRow.fingerprint_key == row.fingerprint_key,
            CompileJobRow.status == JobStatus.FAILED.value,
            *([CompileJobRow.created_at > last_success] if last_success else [])))
    delay = min(base_s * 2 ** max(0, (in_a_row or 1) - 1), max_s)
    retry_at = row.finished_at + timedelta(seconds=delay)
    if row.retry_at != retry_at:
        row.retry_at = retry_at
        session.flush()
    return retry_at


def release_job(session: Session, *, job_id: str, instance: str | None) -> bool:
    """Give a running job back to the queue (``queued``) before its task is retried, so
    that any worker may claim the retry. Only its owner ``instance`` may; returns whether it
    did."""
    row = _locked_job(session, job_id)
    if row.status != JobStatus.RUNNING.value or row.worker_instance != instance:
        return False
    row.status = JobStatus.QUEUED.value
    row.worker_instance = None
    row.worker_pid = None
    row.deadline_at = None
    row.updated_at = utcnow()
    session.flush()
    return True


def mark_enqueued(session: Session, *, job_ids: list[str]) -> None:
    """Record that these jobs' tasks were sent to the broker now."""
    if job_ids:
        session.execute(
            sa.update(CompileJobRow).where(CompileJobRow.id.in_(job_ids))
            .values(enqueued_at=utcnow()).execution_options(synchronize_session=False))


def jobs_to_enqueue(session: Session, *, grace_s: float, requeue_s: float) -> list[CompileJob]:
    """``queued`` and ``waiting_for_hardware`` jobs that may have no task in the broker:

    - never enqueued (the API died between commit and enqueue, or the broker refused) and
      created more than ``grace_s`` ago;
    - ``queued`` with a task sent more than ``requeue_s`` ago (the broker lost it: a Redis
      restart without persistence). A job waiting for hardware keeps its task in its
      queue until a worker for its key appears; it is only sent when it was never sent.

    Sending a job again is harmless: a second delivery of a job that a live worker runs,
    or that has finished, builds nothing (``start_job``). Rows are claimed ``FOR UPDATE
    SKIP LOCKED`` so that several sweepers do not send one job twice at once.
    """
    now = utcnow()
    never = sa.and_(CompileJobRow.enqueued_at.is_(None),
                    CompileJobRow.created_at < now - timedelta(seconds=grace_s))
    stale = sa.and_(CompileJobRow.status == JobStatus.QUEUED.value,
                    CompileJobRow.enqueued_at < now - timedelta(seconds=requeue_s))
    stmt = (
        sa.select(CompileJobRow)
        .where(CompileJobRow.status.in_([JobStatus.QUEUED.value,
                                         JobStatus.WAITING_FOR_HARDWARE.value]))
        .where(sa.or_(never, stale) if requeue_s > 0 else never)
        .order_by(CompileJobRow.created_at)
        .with_for_update(skip_locked=True)
    )
    return [job_from_row(row) for row in session.scalars(stmt)]


def set_job_stage(session: Session, *, job_id: str, stage: JobStage, progress: float) -> None:
    """Report pipeline progress (0..1). Ignored, with a warning, once the job succeeded or
    failed; ``JobCancelled`` once an operator cancelled it, so that a worker whose process
    was not terminated stops at its next stage instead of building on."""
    if not 0.0 <= progress <= 1.0:
        raise InvalidRequest(f"progress must be between 0 and 1, got {progress}")
    row = _locked_job(session, job_id)
    if row.status == JobStatus.CANCELLED.value:
        raise JobCancelled(f"compile job {job_id} was cancelled; stopping before stage "
                           f"{JobStage(stage).value}", job_id=job_id)
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




def succeed_job(
    session: Session, *, job_id: str, artifact_id: str, cache_hit: bool = False
) -> CompileJob:
    """Mark a job succeeded with its artifact. Repeating it is a no-op; ``Conflict`` when the
    job already finished otherwise, ``NotFound`` when the job or artifact is unknown."""
    row = _locked_job(session, job_id)
    if row.status == JobStatus.SUCCEEDED.value and row.artifact_id == artifact_id:
        return job_from_row(row)
    if JobStatus(row.status).terminal:
        raise Conflict(
            f"compile job {job_id} is already {row.status} (artifact {row.artifact_id}); "
            f"cannot mark it succeeded with artifact {artifact_id}",
            job_id=job_id,
        )
    _require_artifact(session, artifact_id)
    finish_row(row, JobStatus.SUCCEEDED)
    row.stage = JobStage.DONE.value
    row.progress = 1.0
    row.artifact_id = artifact_id
    row.cache_hit = cache_hit
    row.error = None
    session.flush()
    return job_from_row(row)


def fail_job(session: Session, *, job_id: str, error: ErrorBody) -> CompileJob:
    """Mark a job failed with a typed error; the stage it failed in is kept. A job that has
    already failed keeps its first error; ``Conflict`` when it already succeeded."""
    row = _locked_job(session, job_id)
    if row.status in (JobStatus.FAILED.value, JobStatus.CANCELLED.value):
        log.info("job %s is already %s; keeping that", job_id, row.status)
        return job_from_row(row)
    if row.status == JobStatus.SUCCEEDED.value:
        raise Conflict(
            f"compile job {job_id} already succeeded (artifact {row.artifact_id}); cannot "
            f"mark it failed with {error.code}: {error.message}",
            job_id=job_id,
        )
    finish_row(row, JobStatus.FAILED)
    row.error = error.model_dump(mode="json")
    session.flush()
    return job_from_row(row)


def cancel_job(session: Session, *, job_id: str) -> tuple[CompileJob, bool]:
    """Cancel a job that has not finished: ``(job, was_running)``; the caller revokes the
    task of a running one. ``Conflict`` naming the state when the job already finished."""
    row = _locked_job(session, job_id)
    state = JobStatus(row.status)
    if state.terminal:
        raise Conflict(
            f"compile job {job_id} is already {state.value}; only a queued, waiting or running "
            f"job can be cancelled" + ("" if state is JobStatus.SUCCEEDED else
                                       " (`kiln jobs retry` queues it again)"),
            job_id=job_id, status=state.value)
    finish_row(row, JobStatus.CANCELLED)
    row.error = ErrorBody(
        code=ErrorCode.CANCELLED,
        message=f"cancelled by an operator while {state.value} at stage {row.stage}",
        details={"status": state.value, "stage": row.stage, "worker": row.worker},
    ).model_dump(mode="json")
    session.flush()
    return job_from_row(row), state is JobStatus.RUNNING


def retry_job(session: Session, *, job_id: str, served: bool) -> tuple[CompileJob, bool]:
    """Queue a failed or cancelled job again, as a new attempt: ``(job, queued_now)``.

    Idempotent: a job that is already queued, waiting or running is returned as it is with
    ``queued_now=False`` (the caller enqueues only when it is True). The job starts with a
    fresh attempt budget and the next task id (``schemas.jobs.task_id``). ``served``: a live
    worker serves its key (else it waits for hardware). ``Conflict`` when it succeeded.
    """
    row = _locked_job(session, job_id)
    state = JobStatus(row.status)
    if state is JobStatus.SUCCEEDED:
        raise Conflict(
            f"compile job {job_id} succeeded (artifact {row.artifact_id}); there is nothing to "
            f"retry (`kiln rebuild MODEL --key KEY` forces a fresh build)",
            job_id=job_id, status=state.value)
    if not state.terminal:
        return job_from_row(row), False
    now = utcnow()
    row.status = (JobStatus.QUEUED if served else JobStatus.WAITING_FOR_HARDWARE).value
    row.stage = JobStage.PENDING.value
    row.progress = 0.0
    row.error = None
    row.attempts = 0
    row.retries = (row.retries or 0) + 1
    row.worker = None
    row.worker_instance = None
    row.worker_pid = None
    row.deadline_at = None
    row.enqueued_at = None
    row.retry_at = None
    row.started_at = None
    row.finished_at = None
    row.updated_at = now
    session.flush()
    log.info("job %s queued again (retry %d)", job_id, row.retries)
    return job_from_row(row), True

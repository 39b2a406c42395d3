"""Celery tasks: thin, named, idempotent. They take a job id and call plain code."""

from __future__ import annotations

import logging
from functools import lru_cache

from celery import Task
from sqlalchemy.exc import OperationalError

from compiler_worker.config import get_worker_settings
from compiler_worker.jobs import JobRunner
from schemas.errors import ErrorBody, ErrorCode, KilnError
from services.queue import COMPILE_TASK, celery_app

logger = logging.getLogger(__name__)

MAX_RETRIES = 5


@lru_cache
def get_runner() -> JobRunner:
    return JobRunner(get_worker_settings())


def _transient(exc: BaseException) -> bool:
    """Failures another attempt may fix (store or database unreachable). Deterministic ones
    (a bad model, failed verification) are recorded on the job by the runner, never retried."""
    return isinstance(exc, OperationalError) or (isinstance(exc, KilnError) and exc.transient)


@celery_app.task(
    name=COMPILE_TASK, bind=True, acks_late=True, reject_on_worker_lost=True,
    max_retries=MAX_RETRIES,
)
def compile_job(self: Task, job_id: str) -> None:
    try:
        get_runner().run(job_id)
    except Exception as exc:
        if not _transient(exc):
            raise
        if self.request.retries >= MAX_RETRIES:
            get_runner().fail(job_id, ErrorBody(
                code=getattr(exc, "code", ErrorCode.STORE_ERROR),
                message=f"gave up after {MAX_RETRIES} retries: {exc}",
            ))
            return
        countdown = min(2 ** self.request.retries, 60)
        logger.warning("job %s: transient failure (%s); retrying in %ss", job_id, exc, countdown)
        raise self.retry(exc=exc, countdown=countdown) from exc

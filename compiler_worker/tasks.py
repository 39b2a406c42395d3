"""Celery tasks: thin, named, idempotent. They take a job id and call plain code. Registered
on the worker's own app (``compiler_worker.queue``) under the names the control plane sends
(``schemas.queue``)."""

from __future__ import annotations

import logging
from functools import lru_cache

from celery import Task

from compiler_worker.config import get_worker_settings
from compiler_worker.jobs import JobRunner, is_transient
from compiler_worker.queue import celery_app
from schemas.errors import ErrorBody, ErrorCode
from schemas.queue import COMPILE_TASK

logger = logging.getLogger(__name__)

#: Retries of a task after a transient failure; ``KILN_MAX_JOB_ATTEMPTS`` usually ends the
#: job first, since each retry that builds is an attempt.
MAX_RETRIES = 5


@lru_cache
def get_runner() -> JobRunner:
    return JobRunner(get_worker_settings())


@celery_app.task(
    name=COMPILE_TASK, bind=True, acks_late=True, reject_on_worker_lost=True,
    max_retries=MAX_RETRIES,
)
def compile_job(self: Task, job_id: str) -> None:
    runner = get_runner()
    try:
        # A retry of this task may find the job still ``running`` under this worker (the
        # API was away when it was released): it takes the job over.
        runner.run(job_id, redelivered=self.request.retries > 0)
    except Exception as exc:
        if not is_transient(exc):
            raise
        if self.request.retries >= MAX_RETRIES:
            runner.fail(job_id, ErrorBody(
                code=getattr(exc, "code", ErrorCode.STORE_ERROR),
                message=f"gave up after {MAX_RETRIES} retries: {exc}",
            ))
            return
        countdown = min(2 ** self.request.retries, 60)
        logger.warning("job %s: transient failure (%s); retrying in %ss", job_id, exc, countdown)
        runner.release(job_id)
        raise self.retry(exc=exc, countdown=countdown) from exc

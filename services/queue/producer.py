"""Enqueueing: called by the API after the job row is committed."""

from __future__ import annotations

import logging

from celery import Celery
from kombu.exceptions import OperationalError

from schemas.errors import QueueUnavailable
from schemas.jobs import task_id as job_task_id
from schemas.queue import COMPILE_TASK, queue_for

logger = logging.getLogger(__name__)

# Fail fast instead of hanging a request when the broker is down.
_RETRY_POLICY = {"max_retries": 2, "interval_start": 0.2, "interval_step": 0.5, "interval_max": 1}


def enqueue_compile(app: Celery, *, job_id: str, fingerprint_key: str,
                    task_id: str | None = None,
                    time_limits: tuple[float, float] | None = None) -> None:
    """Send ``kiln.compile(job_id)`` to ``build.<fingerprint_key>`` under ``task_id``
    (default: ``schemas.jobs.task_id`` of a job never retried): a job sent twice is one job
    (the worker's claim drops a duplicate). ``time_limits`` are the task's (soft, hard)
    limits in seconds."""
    queue = queue_for(fingerprint_key)
    limits = {}
    if time_limits is not None:
        limits = {"soft_time_limit": time_limits[0], "time_limit": time_limits[1]}
    try:
        app.send_task(
            COMPILE_TASK,
            args=[job_id],
            queue=queue,
            routing_key=queue,
            task_id=task_id or job_task_id(job_id),
            retry=True,
            retry_policy=_RETRY_POLICY,
            **limits,
        )
    except OperationalError as exc:
        raise QueueUnavailable(
            f"could not enqueue job {job_id} on {queue}: the broker is unreachable ({exc})",
            job_id=job_id,
        ) from exc
    logger.info("enqueued job %s on %s", job_id, queue)


def revoke_compile(app: Celery, *, task_id: str) -> bool:
    """Stop a compile task: workers drop it if it has not started and terminate the process
    running it if it has. Returns False (and logs why) when the broker cannot be reached; the
    job row is what counts, and a worker leaves a cancelled job alone."""
    try:
        app.control.revoke(task_id, terminate=True, signal="SIGTERM")
    except Exception as exc:  # any transport failure: the cancel itself stands
        logger.warning("could not revoke task %s: %s", task_id, exc)
        return False
    logger.info("revoked task %s", task_id)
    return True

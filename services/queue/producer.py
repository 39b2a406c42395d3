"""Enqueueing: called by the API after the job row is committed."""

from __future__ import annotations

import logging

from celery import Celery
from kombu.exceptions import OperationalError

from schemas.errors import QueueUnavailable
from services.queue.names import COMPILE_TASK, queue_for

logger = logging.getLogger(__name__)

# Fail fast instead of hanging a request when the broker is down.
_RETRY_POLICY = {"max_retries": 2, "interval_start": 0.2, "interval_step": 0.5, "interval_max": 1}


def enqueue_compile(app: Celery, *, job_id: str, fingerprint_key: str) -> None:
    queue = queue_for(fingerprint_key)
    try:
        app.send_task(
            COMPILE_TASK,
            args=[job_id],
            queue=queue,
            routing_key=queue,
            task_id=f"compile-{job_id}",
            retry=True,
            retry_policy=_RETRY_POLICY,
        )
    except OperationalError as exc:
        raise QueueUnavailable(
            f"could not enqueue job {job_id} on {queue}: the broker is unreachable ({exc})",
            job_id=job_id,
        ) from exc
    logger.info("enqueued job %s on %s", job_id, queue)

"""Enqueueing committed compile jobs, for every route and loop of the API that creates them."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from celery import Celery
from sqlalchemy.orm import Session

from schemas import CompileJob
from schemas.errors import QueueUnavailable
from services.db import repo
from services.queue import enqueue_compile

logger = logging.getLogger(__name__)


def enqueue_jobs(session: Session, queue: Celery,
                 jobs: Iterable[CompileJob]) -> QueueUnavailable | None:
    """Send each job's task; call it once the rows are committed (a worker may start at once).

    A job whose task cannot be sent (the broker is down) fails at once with
    ``queue_unavailable``, never left queued with no task behind it. Returns the last such
    error, for a caller that answers a request with it.
    """
    failure = None
    for job in jobs:
        try:
            enqueue_compile(queue, job_id=job.id, fingerprint_key=job.fingerprint_key)
        except QueueUnavailable as exc:
            logger.error("%s", exc.message)
            repo.fail_job(session, job_id=job.id, error=exc.to_body())
            session.commit()
            failure = exc
    return failure

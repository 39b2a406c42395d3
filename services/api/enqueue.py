"""Enqueueing committed compile jobs, for every route and loop of the API that creates them."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from celery import Celery
from sqlalchemy.orm import Session

from schemas import CompileJob
from schemas.errors import QueueUnavailable
from schemas.jobs import task_id
from services.config import KilnSettings
from services.db import repo
from services.queue import enqueue_compile

logger = logging.getLogger(__name__)


def enqueue_jobs(session: Session, queue: Celery, jobs: Iterable[CompileJob], *,
                 fail_unsent: bool = True) -> QueueUnavailable | None:
    """Send each job's task; call it once the rows are committed (a worker may start at once).
    Each job sent records ``enqueued_at``.

    A job whose task cannot be sent (the broker is down) fails at once with
    ``queue_unavailable`` when ``fail_unsent`` (a submit answers 503 and leaves nothing
    behind); otherwise it stays as it is with no ``enqueued_at``, and the API's sweep sends
    it once the broker is back. Returns the last such error, for a caller that answers a
    request with it.
    """
    failure = None
    sent = []
    for job in jobs:
        try:
            send(queue, job)
        except QueueUnavailable as exc:
            logger.error("%s", exc.message)
            if fail_unsent:
                repo.fail_job(session, job_id=job.id, error=exc.to_body())
                session.commit()
            failure = exc
        else:
            sent.append(job.id)
    repo.mark_enqueued(session, job_ids=sent)
    session.commit()
    return failure


def send(queue: Celery, job: CompileJob) -> None:
    """Send one job's task, with time limits from its tuning budget; ``QueueUnavailable``
    when the broker cannot be reached."""
    settings: KilnSettings = queue.kiln_settings  # type: ignore[attr-defined]
    enqueue_compile(queue, job_id=job.id, fingerprint_key=job.fingerprint_key,
                    task_id=task_id(job.id, job.retries),
                    time_limits=settings.job_time_limits(job.options.tuning_budget_s))

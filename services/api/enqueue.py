"""Enqueueing committed compile jobs, for every route and loop of the API that creates them."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from celery import Celery
from sqlalchemy.orm import Session

from schemas.errors import InvalidOptions, QueueUnavailable
from schemas.jobs import CompileJob, task_id
from schemas.options import Precision
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


def check_precision(session: Session, precision: Precision, keys: list[str]) -> None:
    """422 when a targeted key's live workers build no engine of ``precision`` (their
    heartbeats say which they build): queued, the job would fail on the worker. A key no live
    worker reports precisions for is not judged (its job waits for hardware)."""
    built = repo.live_worker_precisions(session)
    refused = sorted(key for key in dict.fromkeys(keys)
                     if key in built and precision.value not in built[key])
    if not refused:
        return
    accepted = {key: sorted(built[key]) for key in refused}
    others = sorted(key for key, names in built.items() if precision.value in names)
    raise InvalidOptions(
        f"precision {precision.value} cannot be built for {refused}: their workers build "
        + "; ".join(f"{key}: {', '.join(names) or 'nothing'}" for key, names in accepted.items())
        + f". Keys whose workers build {precision.value}: {others or 'none live'}",
        precision=precision.value, refused=accepted, keys=others)


def check_deploy_precision(session: Session, precision: Precision,
                           selector: dict[str, str]) -> None:
    """422 when a live agent the deployment selects has no key whose workers build
    ``precision``.

    An agent is judged only when live workers report precisions for at least one of its keys;
    it is refused when none of those keys builds ``precision``: the deployment would queue
    builds that can only fail, and the agent would serve nothing. The answer names the keys
    and what their workers build, so the user narrows the selector or picks a precision. The
    selected agents are read only when some key's workers lack the precision: a deployment
    reads the agents it selects once (the planner's read), not twice, in the common case.
    """
    built = repo.live_worker_precisions(session)
    if all(precision.value in names for names in built.values()):
        return
    refused: dict[str, list[str]] = {}
    for _labels, keys, _compat in repo.selected_agent_keys(session, selector=selector):
        judged = [key for key in dict.fromkeys(keys.values()) if key in built]
        if judged and not any(precision.value in built[key] for key in judged):
            for key in judged:
                refused[key] = sorted(built[key])
    if not refused:
        return
    others = sorted(key for key, names in built.items() if precision.value in names)
    raise InvalidOptions(
        f"precision {precision.value} cannot be built for agents this deployment selects: "
        + "; ".join(f"{key}: their workers build {', '.join(names) or 'nothing'}"
                    for key, names in sorted(refused.items()))
        + f". Keys whose workers build {precision.value}: {others or 'none live'}; narrow "
        "the selector or choose a precision those agents' workers build",
        precision=precision.value, refused=refused, keys=others)

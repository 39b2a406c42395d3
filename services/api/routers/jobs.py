"""``/v1/compile-jobs``: one job per target; rows are committed before tasks are enqueued."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from fastapi import APIRouter, Request, Response, status

from schemas.errors import ErrorBody, InvalidOptions
from schemas.jobs import CompileJob, CompileJobBatch, CompileJobCreate, JobStatus, task_id
from services.api.deps import (
    AdminPrincipal,
    JobId,
    Limit,
    QueueDep,
    ReaderPrincipal,
    Route,
    SessionDep,
    StoreDep,
)
from services.api.enqueue import check_precision, enqueue_jobs
from services.db import repo
from services.integrity import usable_artifact
from services.queue import revoke_compile

logger = logging.getLogger(__name__)


def _exit_if_fault_injected(trigger: Path | None) -> None:
    """Fault injection for ``bench/faults.py`` (``KILN_ENV=dev`` only, see
    ``KilnSettings.check_secure``): die between commit and enqueue, as a crash would."""
    if trigger is not None and trigger.exists():
        trigger.unlink(missing_ok=True)
        logger.error("fault injection: exiting between commit and enqueue (%s)", trigger)
        os._exit(70)
router = APIRouter(prefix="/v1/compile-jobs", tags=["compile jobs"], route_class=Route)


@router.post("", response_model=CompileJobBatch, status_code=status.HTTP_202_ACCEPTED)
def create_compile_jobs(
    request: CompileJobCreate, session: SessionDep, queue: QueueDep, store: StoreDep,
    _: AdminPrincipal, http: Request,
) -> Response:
    model = repo.lookup_model(session, request.model_id)  # 404 before any write
    request = request.model_copy(update={"model_id": model.id})
    repo.check_compile_datasets(session, model=model, options=request.options)
    digest = request.options.digest()
    served, formats = repo.live_workers(session)
    refused = {key: sorted(formats[key]) for key in dict.fromkeys(
        t.fingerprint_key for t in request.targets)
        if key in formats and model.format not in formats[key]}
    if refused:
        takes = sorted(k for k, names in formats.items() if model.format in names)
        raise InvalidOptions(
            f"model {model.id[:16]} is a {model.format} model; the workers of "
            f"{sorted(refused)} build {sorted({f for v in refused.values() for f in v})} "
            f"models. Keys whose workers take {model.format} models: {takes or 'none live'}",
            refused=refused, model_format=model.format, keys=takes)
    check_precision(session, request.options.precision,
                    [t.fingerprint_key for t in request.targets])
    jobs: list[CompileJob] = []
    to_enqueue: list[CompileJob] = []
    found_broken = False
    for key in dict.fromkeys(t.fingerprint_key for t in request.targets):  # dedupe, keep order
        cached = repo.find_current_artifact(
            session, model_id=request.model_id, options_digest=digest, fingerprint_key=key
        )
        if cached is not None:
            if usable_artifact(session, store, cached.id):
                jobs.append(repo.create_cached_job(
                    session, model_id=request.model_id, options=request.options,
                    fingerprint_key=key, artifact_id=cached.id, read=True,
                    options_digest=digest,
                ))
                continue
            found_broken = True
        active = repo.find_active_job(
            session, model_id=request.model_id, options_digest=digest, fingerprint_key=key
        )
        if active is not None:
            jobs.append(active)
            continue
        job = repo.create_job(
            session, model_id=request.model_id, options=request.options, fingerprint_key=key
        )
        if key not in served:  # its task waits in build.<key> until such a worker appears
            repo.set_job_status(session, job_id=job.id, status=JobStatus.WAITING_FOR_HARDWARE)
        jobs.append(job)
        to_enqueue.append(job)
    session.commit()  # the rows exist before any worker can pick a task up
    if found_broken:  # agents handed that engine must hear of it now
        http.app.state.desired_hub.models_changed({request.model_id})
    _exit_if_fault_injected(queue.kiln_settings.debug_exit_after_commit_file)
    failure = enqueue_jobs(session, queue, to_enqueue)
    if failure is not None:
        raise failure
    # Only the jobs just queued changed since they were read (the enqueue marks them).
    queued = {j.id for j in to_enqueue}
    batch = CompileJobBatch(jobs=[repo.get_job(session, job_id=j.id) if j.id in queued else j
                                  for j in jobs])
    # Hand the connection back now, not when the request's dependencies are torn down after
    # the answer: held until then, a burst of submissions would hold every pooled connection.
    session.commit()
    # Serialized here, in the route's thread: the model is the one ``response_model`` names,
    # built just above. Returned as a model, FastAPI would validate it again, in a second hop
    # to the thread pool (this is a ``def`` route): CPU the API spends on every cached answer
    # for nothing (`bench/submit_to_artifact.py` times the submissions).
    return Response(batch.model_dump_json(), status_code=status.HTTP_202_ACCEPTED,
                    media_type="application/json")


@router.get("", response_model=list[CompileJob])
def list_compile_jobs(
    session: SessionDep,
    _: ReaderPrincipal,
    model_id: str | None = None,
    status: JobStatus | None = None,
    limit: Limit = 100,
) -> list[CompileJob]:
    if model_id is not None:
        model_id = repo.resolve_id(session, "model", model_id)
    return repo.list_jobs(session, model_id=model_id, status=status, limit=limit)


@router.get("/{job_id}", response_model=CompileJob)
def get_compile_job(job_id: JobId, session: SessionDep) -> CompileJob:
    return repo.get_job(session, job_id=job_id)


_TERMINAL = {409: {"model": ErrorBody, "description": "the job already finished; the body "
                                                      "names its status"}}


@router.post("/{job_id}/cancel", response_model=CompileJob, responses=_TERMINAL)
def cancel_compile_job(
    _: AdminPrincipal, job_id: JobId, session: SessionDep, queue: QueueDep
) -> CompileJob:
    """Cancel a queued, waiting or running job. A running job's task is revoked (its worker
    process is terminated) after the row says ``cancelled``; a worker that still finishes it
    records nothing. 409 naming the status when the job already finished."""
    job, running = repo.cancel_job(session, job_id=job_id)
    session.commit()
    if running or job.worker is not None:
        revoke_compile(queue, task_id=task_id(job.id, job.retries))
    logger.info("job %s cancelled", job_id)
    return job


@router.post("/{job_id}/retry", response_model=CompileJob, responses={
    409: {"model": ErrorBody, "description": "the job succeeded: nothing to retry"},
    503: {"model": ErrorBody, "description": "the broker is unreachable"}})
def retry_compile_job(
    _: AdminPrincipal, job_id: JobId, session: SessionDep, queue: QueueDep
) -> CompileJob:
    """Queue a failed or cancelled job again as a new attempt (fresh attempt budget, its own
    task id). Idempotent: a job already queued, waiting or running is returned unchanged and
    nothing is sent twice. 409 when the job succeeded."""
    current = repo.get_job(session, job_id=job_id)
    served = current.fingerprint_key in repo.live_worker_keys(session)
    job, queued = repo.retry_job(session, job_id=job_id, served=served)
    session.commit()
    if queued:
        failure = enqueue_jobs(session, queue, [job])
        if failure is not None:
            raise failure
    return repo.get_job(session, job_id=job_id)

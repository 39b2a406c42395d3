"""``/v1/compile-jobs``: one job per target; rows are committed before tasks are enqueued."""

from __future__ import annotations

import logging

from fastapi import APIRouter, status

from artifact_store import ArtifactStore
from schemas import CompileJob, CompileJobCreate, JobStatus
from schemas.jobs import CompileJobBatch
from services.api.deps import (
    AdminPrincipal,
    Limit,
    QueueDep,
    ReaderPrincipal,
    SessionDep,
    StoreDep,
)
from services.api.enqueue import enqueue_jobs
from services.db import repo

logger = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/compile-jobs", tags=["compile jobs"])


@router.post("", response_model=CompileJobBatch, status_code=status.HTTP_202_ACCEPTED)
def create_compile_jobs(
    request: CompileJobCreate, session: SessionDep, queue: QueueDep, store: StoreDep,
    _: AdminPrincipal,
) -> CompileJobBatch:
    model = repo.get_model(session, model_id=request.model_id)  # 404 before any write
    repo.check_compile_datasets(session, model=model, options=request.options)
    digest = request.options.digest()
    served = repo.live_worker_keys(session)
    jobs: list[CompileJob] = []
    to_enqueue: list[CompileJob] = []
    for key in dict.fromkeys(t.fingerprint_key for t in request.targets):  # dedupe, keep order
        cached = repo.find_artifact(
            session, model_id=request.model_id, options_digest=digest, fingerprint_key=key
        )
        if (cached is not None and repo.plugins_current(session, artifact_id=cached.id)
                and _blobs_present(store, cached.id)):
            jobs.append(repo.create_cached_job(
                session, model_id=request.model_id, options=request.options,
                fingerprint_key=key, artifact_id=cached.id,
            ))
            continue
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
    failure = enqueue_jobs(session, queue, to_enqueue)
    if failure is not None:
        raise failure
    return CompileJobBatch(jobs=[repo.get_job(session, job_id=j.id) for j in jobs])


def _blobs_present(store: ArtifactStore, artifact_id: str) -> bool:
    """Whether a cached artifact's manifest and blobs are still in the store (a HEAD or a
    stat each): a hit on a lost blob is no hit, and a build is queued instead."""
    missing = store.missing_parts(artifact_id)
    if missing:
        logger.warning("artifact %s is recorded but the store lacks %s; queueing a rebuild",
                       artifact_id, missing)
    return not missing


@router.get("", response_model=list[CompileJob])
def list_compile_jobs(
    session: SessionDep,
    _: ReaderPrincipal,
    model_id: str | None = None,
    status: JobStatus | None = None,
    limit: Limit = 100,
) -> list[CompileJob]:
    return repo.list_jobs(session, model_id=model_id, status=status, limit=limit)


@router.get("/{job_id}", response_model=CompileJob)
def get_compile_job(job_id: str, session: SessionDep, _: ReaderPrincipal) -> CompileJob:
    return repo.get_job(session, job_id=job_id)

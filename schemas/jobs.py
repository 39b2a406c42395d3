"""Compile jobs: what a user asks for and what the API reports back."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from schemas.errors import ErrorBody
from schemas.options import CompileOptions


class JobStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    WAITING_FOR_HARDWARE = "waiting_for_hardware"
    #: Stopped by an operator (``POST /v1/compile-jobs/{id}/cancel``); ``/retry`` queues it again.
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)


class JobStage(StrEnum):
    PENDING = "pending"
    LOADING = "loading"
    CHECKING = "checking"
    OPTIMIZING = "optimizing"
    BUILDING = "building"
    VERIFYING = "verifying"
    BENCHMARKING = "benchmarking"
    PUBLISHING = "publishing"
    DONE = "done"


class JobTarget(BaseModel):
    """Where to build: a fingerprint key (one queue per key)."""

    model_config = ConfigDict(extra="forbid")

    fingerprint_key: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_.\-]+$")


class CompileJobCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_id: str = Field(min_length=1)
    options: CompileOptions = Field(default_factory=CompileOptions)
    targets: list[JobTarget] = Field(min_length=1, max_length=64)


class CompileJob(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    model_id: str
    options: CompileOptions
    options_digest: str
    fingerprint_key: str
    status: JobStatus
    stage: JobStage
    progress: float = Field(ge=0, le=1)
    error: ErrorBody | None = None
    artifact_id: str | None = None
    #: True when the job was answered from an existing artifact with no build.
    cache_hit: bool = False
    #: Builds started for this job (a publish resumed from kept outputs is not one).
    attempts: int = 0
    #: How many times an operator asked for this job again (``/retry``); each retry is sent
    #: under its own task id, so a revoked earlier task never shadows it.
    retries: int = 0
    #: A forced rebuild (``kiln rebuild``): the worker ignores an existing artifact for the key.
    force: bool = False
    worker: str | None = None
    #: The worker process (a new id at every start of a worker) that owns a running job.
    worker_instance: str | None = None
    #: The pool process of that instance that builds it.
    worker_pid: int | None = None
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    #: When its task was last sent to the broker; ``None``: not yet (the sweep sends it).
    enqueued_at: datetime | None = None
    #: A running job not finished by then fails ``timed_out``.
    deadline_at: datetime | None = None
    #: Failed, behind a deployment: a new build is queued from this time on (backoff).
    retry_at: datetime | None = None


def task_id(job_id: str, retries: int = 0) -> str:
    """The Celery task id of a job's current attempt: one per operator retry."""
    return f"compile-{job_id}" if retries == 0 else f"compile-{job_id}-retry{retries}"


class CompileJobBatch(BaseModel):
    """The answer to ``POST /v1/compile-jobs``: one job per target."""

    jobs: list[CompileJob]

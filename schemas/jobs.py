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

    @property
    def terminal(self) -> bool:
        return self in (JobStatus.SUCCEEDED, JobStatus.FAILED)


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
    attempts: int = 0
    worker: str | None = None
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None


class CompileJobBatch(BaseModel):
    """The answer to ``POST /v1/compile-jobs``: one job per target."""

    jobs: list[CompileJob]

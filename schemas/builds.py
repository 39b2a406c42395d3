"""Wire models of the worker-facing build routes (``/v1/builds``): a compiler worker claims a
job, reports its stages, asks the cache, fetches its inputs, heartbeats, and hands its
candidate bundle to the control plane, which re-hashes it, signs the manifest and records the
artifact. Workers hold no signing key, no database URL and no store credentials."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from schemas.agents import FingerprintKey
from schemas.fingerprint import HardwareFingerprint
from schemas.jobs import CompileJob, JobStage
from schemas.manifest import ArtifactManifest
from schemas.options import Precision
from schemas.tuning import TuningTable


class BuildCompletion(BaseModel):
    """``POST /v1/builds/{job_id}/complete``: the build's manifest, unsigned, naming blobs the
    worker uploaded first (``PUT /v1/builds/{job_id}/blobs/{name}``)."""

    model_config = ConfigDict(extra="forbid")

    manifest: ArtifactManifest
    #: A forced rebuild (``kiln rebuild``): replace a manifest already stored for the id.
    replace: bool = False


class BuildPublished(BaseModel):
    """What ``complete`` recorded: the artifact, whether this call created it (``False``: a
    retried call, or a build of a key already recorded), and the job as it now stands."""

    artifact_id: str
    created: bool
    job: CompileJob


#: A pool process id (``/proc/sys/kernel/pid_max`` is at most 2**22).
_PID = Field(ge=1, le=2**31 - 1)
_NAME = Field(min_length=1, max_length=200)


class BuildClaim(BaseModel):
    """``POST /v1/builds/{job_id}/claim``: a worker process asks to build a job."""

    model_config = ConfigDict(extra="forbid")

    #: The worker's name (``KILN_WORKER_NAME``) and this start's instance id.
    worker: str = _NAME
    instance: str = _NAME
    #: The pool process that will build.
    pid: int = _PID
    #: A retry of the task after a transient failure: the job may still be ``running``
    #: under this worker (its release was lost), and is taken over.
    redelivered: bool = False
    #: Resume the publish of a build kept from an earlier delivery: no new attempt counted.
    resume: bool = False
    #: A process of this same instance that the worker found dead: a job this instance
    #: claimed with that pid is taken over (a pool child killed mid-build). Only the
    #: claimant's own instance's processes can be declared dead this way.
    dead_pid: int | None = Field(default=None, ge=1, le=2**31 - 1)


class ClaimedJob(BaseModel):
    """The job, now ``running`` under the claimant, and the attempt limit it runs under."""

    job: CompileJob
    max_attempts: int
    #: The claim's proof: the routes that write into the job (blob uploads, the publish)
    #: take it in ``X-Kiln-Claim`` from the instance that claimed it, and from no other.
    lease: str | None = None


class JobRelease(BaseModel):
    """``POST /v1/builds/{job_id}/release``: give a running job back to the queue before its
    task is retried."""

    model_config = ConfigDict(extra="forbid")

    instance: str = _NAME


class JobReleased(BaseModel):
    released: bool


class StageReport(BaseModel):
    """``POST /v1/builds/{job_id}/stage``: the pipeline's progress."""

    model_config = ConfigDict(extra="forbid")

    stage: JobStage
    progress: float = Field(ge=0.0, le=1.0)


class CacheQuery(BaseModel):
    """``POST /v1/builds/{job_id}/cache``: the toolchain the worker would build with; with the
    job's model, options digest and fingerprint key it makes the cache key."""

    model_config = ConfigDict(extra="forbid")

    toolchain: str = Field(min_length=1, max_length=500)


class CacheAnswer(BaseModel):
    """A hit (``artifact_id``, and the job finished as a cache hit) only for an artifact whose
    manifest and blobs are all in the store; otherwise the tuning record of the same key,
    if any, for the tuner to reuse."""

    artifact_id: str | None = None
    job: CompileJob
    tuning: TuningTable | None = None

    @property
    def hit(self) -> bool:
        return self.artifact_id is not None


class PluginQuery(BaseModel):
    """``POST /v1/builds/{job_id}/plugins``: the custom ops (``domain::OpType``) the job's
    model uses."""

    model_config = ConfigDict(extra="forbid")

    ops: list[str] = Field(max_length=1000)


class WorkerHeartbeat(BaseModel):
    """``PUT /v1/builds/workers/{name}``: a compiler worker is alive (or, with ``stopping``,
    shut down), consumes the queues of ``fingerprint_keys`` and beats every
    ``heartbeat_s``."""

    model_config = ConfigDict(extra="forbid")

    instance: str = _NAME
    fingerprint_keys: list[FingerprintKey] = Field(max_length=64)
    fingerprint: HardwareFingerprint
    portable_keys: dict[FingerprintKey, FingerprintKey] = Field(default_factory=dict,
                                                                max_length=64)
    model_formats: dict[FingerprintKey, list[Annotated[str, Field(max_length=50)]]] = Field(
        default_factory=dict, max_length=64)
    #: Fingerprint key → the precision policies its backend builds (``WorkerInfo.precisions``);
    #: a key left out is not constrained (a worker from before workers said).
    precisions: dict[FingerprintKey, list[Precision]] = Field(default_factory=dict,
                                                              max_length=64)
    heartbeat_s: float = Field(gt=0, le=86400)
    stopping: bool = False

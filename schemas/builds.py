"""Wire models of the worker-facing build routes (``/v1/builds``): a compiler worker hands its
candidate bundle to the control plane, which re-hashes it, signs the manifest and records the
artifact. Workers never hold the signing key."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from schemas.jobs import CompileJob
from schemas.manifest import ArtifactManifest


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

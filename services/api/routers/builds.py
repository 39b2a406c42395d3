"""``/v1/builds``: the routes a compiler worker speaks to publish a build.

A worker holds no signing key and no store credentials. It uploads each blob of its candidate
bundle through the API (``PUT /v1/builds/{job_id}/blobs/{name}``, streamed, with the sha256 it
computed in ``X-Kiln-Sha256``), then asks the control plane to publish
(``POST /v1/builds/{job_id}/complete``). The control plane then:

1. checks the job is running and is one the worker token may build (its fingerprint key);
2. checks the manifest belongs to the job: model, options digest, fingerprint key, and the
   artifact id those derive with the toolchain;
3. re-hashes every blob the manifest names from the store, refusing a size or sha256 that
   does not match;
4. only then signs the manifest (``services.signer``), publishes it and records the artifact,
   its tuning table and the job's success, once per job: a retried call answers the same.

A cancelled job's ``complete`` is refused (409) and nothing is signed or recorded.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request
from fastapi import Path as PathParam
from starlette.concurrency import run_in_threadpool

from artifact_store import ArtifactStore
from schemas import BlobRef, CompileJob, JobStatus
from schemas._canonical import canonical_json, sha256_hex
from schemas.builds import BuildCompletion, BuildPublished
from schemas.errors import Conflict, ErrorCode, InvalidRequest, KilnError
from schemas.manifest import ArtifactManifest
from services.api.auth import Principal, Role, check_worker_key
from services.api.deps import RoleDep, SessionDep, SignerDep, StoreDep
from services.api.gate import BODY_LIMIT
from services.db import repo

logger = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/builds", tags=["builds"])

WorkerPrincipal = RoleDep(Role.WORKER)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
BLOB_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$"


class BuildRefused(KilnError):
    """Bytes or a manifest a worker sent that do not hash or match as it says: refused with
    422 (the worker's input, not a store fault, so not retried), nothing stored or signed."""

    code = ErrorCode.INTEGRITY_ERROR

    @property
    def http_status(self) -> int:
        return 422


def artifact_id_for(model_sha256: str, options_digest: str, fingerprint_key: str,
                    toolchain: str) -> str:
    """The artifact id of a cache key (the same rule as the compiler's ``artifact_id_for``:
    the first 32 hex chars of the sha256 of the canonical key)."""
    return sha256_hex(canonical_json({
        "model_sha256": model_sha256, "options_digest": options_digest,
        "fingerprint_key": fingerprint_key, "toolchain": toolchain,
    }))[:32]


def _building_job(session, principal: Principal, job_id: str, *,
                  lock: bool = False) -> CompileJob:
    """The job, when this worker token may build it and it is running; else 403/404/409.
    With ``lock``, its row stays locked until the session ends."""
    job = (repo.lock_job if lock else repo.get_job)(session, job_id=job_id)
    check_worker_key(principal, job.fingerprint_key)
    if job.status is not JobStatus.RUNNING:
        raise Conflict(f"compile job {job_id} is {job.status.value}, not running: nothing is "
                       f"published for it", job_id=job_id, status=job.status.value)
    return job


@router.put(
    "/{job_id}/blobs/{name}",
    response_model=BlobRef,
    openapi_extra={BODY_LIMIT: "max_upload_bytes"},
)
async def upload_blob(
    request: Request,
    session: SessionDep,
    store: StoreDep,
    principal: WorkerPrincipal,
    job_id: str,
    name: Annotated[str, PathParam(pattern=BLOB_NAME_PATTERN)],
    x_kiln_sha256: Annotated[str, Header(
        description="the sha256 the worker computed for these bytes; bytes that hash "
                    "otherwise are refused and not stored")],
    media_type: Annotated[str, Query(max_length=200)] = "application/octet-stream",
) -> BlobRef:
    """Store one blob of a running job's build, streamed; refused (422) when the bytes do not
    hash to ``X-Kiln-Sha256``."""
    if not _SHA256.match(x_kiln_sha256):
        raise InvalidRequest(f"X-Kiln-Sha256 must be 64 lowercase hex digits; got "
                             f"{x_kiln_sha256[:80]!r}")
    await run_in_threadpool(_building_job, session, principal, job_id)
    session.rollback()  # no transaction held open while the body streams
    fd, tmp = tempfile.mkstemp(prefix="kiln-build-blob-")
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as f:
            async for chunk in request.stream():
                digest.update(chunk)
                await run_in_threadpool(f.write, chunk)
        if digest.hexdigest() != x_kiln_sha256:
            raise BuildRefused(
                f"blob {name!r} of job {job_id}: the bytes received hash to "
                f"{digest.hexdigest()}, not the {x_kiln_sha256} the worker declared; "
                f"nothing was stored", blob=name, expected_sha256=x_kiln_sha256,
                actual_sha256=digest.hexdigest())
        ref = await run_in_threadpool(store.put_blob, Path(tmp), name=name,
                                      media_type=media_type)
    finally:
        Path(tmp).unlink(missing_ok=True)
    logger.info("job %s: received blob %s (%s, %d bytes)", job_id, name, ref.sha256, ref.size)
    return ref


def _check_belongs(job: CompileJob, manifest: ArtifactManifest) -> None:
    wrong = {field: (got, want) for field, got, want in (
        ("model_sha256", manifest.model_sha256, job.model_id),
        ("options_digest", manifest.options_digest, job.options_digest),
        ("options_digest of options", manifest.options.digest(), job.options_digest),
        ("fingerprint_key", manifest.fingerprint_key, job.fingerprint_key),
    ) if got != want}
    expected_id = artifact_id_for(job.model_id, job.options_digest, job.fingerprint_key,
                                  manifest.toolchain)
    if manifest.artifact_id != expected_id:
        wrong["artifact_id"] = (manifest.artifact_id, expected_id)
    if wrong:
        raise InvalidRequest(
            f"the manifest does not belong to compile job {job.id}: "
            + "; ".join(f"{k} is {got!r}, the job's is {want!r}"
                        for k, (got, want) in wrong.items()),
            job_id=job.id, mismatched=sorted(wrong))


def _rehash(store: ArtifactStore, manifest: ArtifactManifest) -> None:
    """Every blob the manifest names, read back from the store and hashed: its size and
    sha256 must be the manifest's."""
    if not manifest.blobs:
        raise InvalidRequest(f"the manifest of artifact {manifest.artifact_id} names no blobs")
    for ref in manifest.blobs:
        digest = hashlib.sha256()
        size = 0
        try:
            for chunk in store.open_blob(ref):
                digest.update(chunk)
                size += len(chunk)
        except KilnError as exc:
            raise BuildRefused(
                f"blob {ref.name!r} ({ref.sha256}, {ref.size} bytes) of artifact "
                f"{manifest.artifact_id} was not uploaded as described: {exc.message}; "
                f"upload it with PUT /v1/builds/{{job_id}}/blobs/{ref.name} first",
                blob=ref.name) from exc
        if size != ref.size or digest.hexdigest() != ref.sha256:
            raise BuildRefused(
                f"blob {ref.name!r} of artifact {manifest.artifact_id}: the store holds "
                f"{size} bytes with sha256 {digest.hexdigest()}; the manifest says {ref.size} "
                f"bytes with sha256 {ref.sha256}", blob=ref.name)


@router.post("/{job_id}/complete", response_model=BuildPublished)
def complete_build(
    completion: BuildCompletion,
    session: SessionDep,
    store: StoreDep,
    signer: SignerDep,
    principal: WorkerPrincipal,
    job_id: str,
    http: Request,
) -> BuildPublished:
    """Publish a running job's build: check the manifest belongs to the job, re-hash its blobs,
    sign it, record the artifact and the job's success. Repeating the call after it succeeded
    answers the same artifact (``created`` false) and records nothing new."""
    manifest = completion.manifest
    job = repo.get_job(session, job_id=job_id)
    check_worker_key(principal, job.fingerprint_key)
    if job.status is JobStatus.SUCCEEDED and job.artifact_id == manifest.artifact_id:
        return BuildPublished(artifact_id=job.artifact_id, created=False, job=job)
    # The row stays locked until the commit: a cancel waits, then finds the job finished; a
    # job cancelled before is refused here (409) and nothing is signed.
    job = _building_job(session, principal, job_id, lock=True)
    _check_belongs(job, manifest)
    _rehash(store, manifest)
    published = store.publish_manifest(manifest, signer.signer(), replace=completion.replace)
    artifact, created = repo.record_artifact(session, model_id=job.model_id,
                                             manifest=published, replace=completion.replace)
    if published.tuning is not None:
        repo.record_tuning(session, model_id=job.model_id, options_digest=job.options_digest,
                           fingerprint_key=published.fingerprint_key,
                           toolchain=published.toolchain, table=published.tuning)
    done = repo.succeed_job(session, job_id=job_id, artifact_id=artifact.id)
    session.commit()
    # The agents waiting for this engine hear of it now, not at the next re-check.
    http.app.state.desired_hub.models_changed({job.model_id})
    logger.info("job %s: artifact %s %s (signed by key %s)", job_id, artifact.id,
                "recorded" if created else "already recorded", signer.signer().key_id)
    return BuildPublished(artifact_id=artifact.id, created=created, job=done)

"""``/v1/builds``: the routes a compiler worker speaks. A worker holds no database URL, no
store credentials, no signing key and no JWT secret: everything it needs of the control plane
goes through these routes, with a worker token scoped to its fingerprint keys (a job of
another key is 403).

=======================================  ================================================
``PUT /v1/builds/workers/{name}``        heartbeat (or shutdown) of a worker instance
``POST /v1/builds/{job_id}/claim``       claim the job for this worker process; an attempt
                                         is counted here (over the limit the job fails
                                         ``worker_lost``); 409 ``claim_refused`` when the
                                         job cannot be given (a live owner, cancelled,
                                         finished)
``POST /v1/builds/{job_id}/release``     give it back to the queue before a retry
``POST /v1/builds/{job_id}/stage``       report a stage (409 ``cancelled`` stops the build)
``POST /v1/builds/{job_id}/fail``        fail it with a typed reason
``POST /v1/builds/{job_id}/cache``       a hit only for an artifact whole in the store
``GET /v1/builds/{job_id}/model``        the job's model, streamed
``GET .../datasets/{dataset_id}``        a dataset the job's options name, streamed
``POST /v1/builds/{job_id}/plugins``     the plugins providing the model's custom ops
``GET .../plugins/{digest}``             a plugin bundle, streamed
=======================================  ================================================

Publishing: It uploads each blob of its candidate
bundle through the API (``PUT /v1/builds/{job_id}/blobs/{name}``, streamed, with the sha256 it
computed in ``X-Kiln-Sha256``), then asks the control plane to publish
(``POST /v1/builds/{job_id}/complete``). The control plane then:

1. checks the job is running, is one the worker token may build (its fingerprint key), and
   that the caller is the worker instance that claimed it: the claim answers a lease
   (``ClaimedJob.lease``, a MAC of the job and the claiming instance under the API's secret),
   which uploads and the publish carry in ``X-Kiln-Claim``. A worker token is shared by
   every instance of a worker (and the embedded stack's by all its workers), so the key
   alone would let one instance write into another's running job;
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
import hmac
import logging
import os
import re
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from artifact_store.base import ArtifactStore
from schemas._canonical import canonical_json, sha256_hex
from schemas._versioned import parse_version
from schemas.builds import (
    BuildClaim,
    BuildCompletion,
    BuildPublished,
    CacheAnswer,
    CacheQuery,
    ClaimedJob,
    JobRelease,
    JobReleased,
    PluginQuery,
    StageReport,
    WorkerHeartbeat,
)
from schemas.errors import (
    ClaimRefused,
    Conflict,
    ErrorBody,
    ErrorCode,
    Forbidden,
    InvalidRequest,
    KilnError,
    NotFound,
    UnknownOperator,
)
from schemas.jobs import CompileJob, JobStatus
from schemas.manifest import MANIFEST_SCHEMA_VERSION, ArtifactManifest, BlobRef
from schemas.plugins import PluginInfo
from schemas.workers import WorkerInfo
from services.api.auth import Principal, Role, check_worker_key
from services.api.deps import RoleDep, Route, SessionDep, SettingsDep, SignerDep, StoreDep
from services.api.gate import BODY_LIMIT
from services.api.threads import run_slow
from services.api.transfers import scratch_of
from services.db import repo
from services.db.tables import utcnow
from services.integrity import usable_artifact

logger = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/builds", tags=["builds"], route_class=Route)

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


#: The header carrying a claim's lease on the routes that write into a job.
CLAIM_HEADER = "X-Kiln-Claim"


def claim_lease(secret: str, job_id: str, instance: str) -> str:
    """The lease of ``job_id`` claimed by worker ``instance``: only the claim's answer carries
    it (instance ids are visible to every reader of the job), and no one without the API's
    secret can derive it."""
    return hmac.new(secret.encode(), f"kiln-claim\0{job_id}\0{instance}".encode(),
                    hashlib.sha256).hexdigest()


def check_claimant(principal: Principal, job: CompileJob, lease: str | None,
                   secret: str) -> None:
    """A worker writes only into a job its own instance claimed: ``lease`` must be the one
    the claim answered. Admins are not workers and need none."""
    if principal.role is not Role.WORKER:
        return
    if not lease:
        raise Forbidden(f"compile job {job.id} is written only by the worker instance that "
                        f"claimed it: send the lease the claim answered "
                        f"(ClaimedJob.lease) in {CLAIM_HEADER}", job_id=job.id)
    if job.worker_instance is None or not hmac.compare_digest(
            lease, claim_lease(secret, job.id, job.worker_instance)):
        raise Forbidden(f"compile job {job.id} was claimed by worker instance "
                        f"{job.worker_instance!r} ({job.worker}); the lease sent in "
                        f"{CLAIM_HEADER} is not that claim's, so this caller may not write "
                        f"into it", job_id=job.id, owner=job.worker,
                        owner_instance=job.worker_instance)


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


def _claimed_job(session, principal: Principal, job_id: str, lease: str | None,
                 secret: str, *, lock: bool = False) -> CompileJob:
    """``_building_job``, when the caller is the instance that claimed it (403 otherwise)."""
    job = _building_job(session, principal, job_id, lock=lock)
    check_claimant(principal, job, lease, secret)
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
    settings: SettingsDep,
    principal: WorkerPrincipal,
    job_id: str,
    name: Annotated[str, PathParam(pattern=BLOB_NAME_PATTERN)],
    x_kiln_sha256: Annotated[str, Header(
        description="the sha256 the worker computed for these bytes; bytes that hash "
                    "otherwise are refused and not stored")],
    x_kiln_claim: Annotated[str | None, Header(
        max_length=128, description="the lease the claim answered (`ClaimedJob.lease`): "
        "only the worker instance that claimed the job writes into it")] = None,
    media_type: Annotated[str, Query(max_length=200)] = "application/octet-stream",
) -> BlobRef:
    """Store one blob of a running job's build, streamed; refused (422) when the bytes do not
    hash to ``X-Kiln-Sha256``, and (403) unless the caller claimed the job."""
    if not _SHA256.match(x_kiln_sha256):
        raise InvalidRequest(f"X-Kiln-Sha256 must be 64 lowercase hex digits; got "
                             f"{x_kiln_sha256[:80]!r}")
    await run_in_threadpool(_claimed_job, session, principal, job_id, x_kiln_claim,
                            settings.secret_key)
    session.rollback()  # no transaction held open while the body streams
    fd, tmp = tempfile.mkstemp(prefix="kiln-build-blob-", dir=scratch_of(request))
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
        ref = await run_slow(request, store.put_blob, Path(tmp), name=name,
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


def _check_version(manifest: ArtifactManifest) -> None:
    """The manifest is of a version this control plane writes: its major, no newer minor. It
    signs what it publishes: a manifest of another major, signed, would be refused by every
    reader (``schema_unsupported`` at each fetch), and a newer minor would vouch for a format
    it does not know."""
    mine = parse_version(MANIFEST_SCHEMA_VERSION, what="this control plane's manifest")
    theirs = parse_version(manifest.schema_version, what="the manifest")
    if theirs[0] != mine[0] or theirs[1] > mine[1]:
        raise InvalidRequest(
            f"manifest.schema_version is {manifest.schema_version!r}; this control plane "
            f"publishes manifests of version {mine[0]}.0 up to {MANIFEST_SCHEMA_VERSION} (a "
            f"worker of another Kiln release built it: run one of this release)",
            field="manifest.schema_version", supported=MANIFEST_SCHEMA_VERSION)


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
    settings: SettingsDep,
    principal: WorkerPrincipal,
    job_id: str,
    http: Request,
    x_kiln_claim: Annotated[str | None, Header(
        max_length=128, description="the lease the claim answered (`ClaimedJob.lease`)")] = None,
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
    job = _claimed_job(session, principal, job_id, x_kiln_claim, settings.secret_key, lock=True)
    _check_version(manifest)
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


# ---------------------------------------------------------------- a worker's life
@router.put("/workers/{name}", response_model=WorkerInfo)
def worker_heartbeat(
    beat: WorkerHeartbeat,
    session: SessionDep,
    principal: WorkerPrincipal,
    name: Annotated[str, PathParam(min_length=1, max_length=200)],
) -> WorkerInfo:
    """A compiler worker instance is alive and consumes the queues of its fingerprint keys
    (each of which its token must name), or, with ``stopping``, has shut down. A beat from a
    new instance under the same name is a restart: the jobs the old one owned are orphaned."""
    for key in beat.fingerprint_keys:
        check_worker_key(principal, key)
    info = repo.heartbeat_worker(
        session, name=name, fingerprint_keys=beat.fingerprint_keys,
        fingerprint=beat.fingerprint, portable_keys=beat.portable_keys,
        model_formats=beat.model_formats, heartbeat_s=beat.heartbeat_s,
        precisions={k: [p.value for p in v] for k, v in beat.precisions.items()},
        stopping=beat.stopping, instance=beat.instance)
    session.commit()
    return info


def _scoped_job(session, principal: Principal, job_id: str, *, lock: bool = False
                ) -> CompileJob:
    """The job, when this worker token may act on it (403 otherwise)."""
    job = (repo.lock_job if lock else repo.get_job)(session, job_id=job_id)
    check_worker_key(principal, job.fingerprint_key)
    return job


@router.post("/{job_id}/claim", response_model=ClaimedJob,
             responses={409: {"description": "`claim_refused`: another live worker builds "
                                             "the job, it was cancelled, or it has finished"}})
def claim_job(
    claim: BuildClaim,
    session: SessionDep,
    settings: SettingsDep,
    principal: WorkerPrincipal,
    job_id: str,
) -> ClaimedJob:
    """Claim a job for the calling worker process: it becomes ``running`` under it, with a
    deadline, and one more attempt is counted (not for ``resume``). A job past
    ``KILN_MAX_JOB_ATTEMPTS`` fails ``worker_lost`` instead, and the claim is refused (409
    ``claim_refused``, ``details.status`` ``failed``), as is one a live owner runs (a
    duplicate delivery), one cancelled and one finished. The owner is judged alive by its
    heartbeats; for a process of the claimant's own instance the claimant says it is dead
    (``dead_pid``), since only that machine can tell."""
    current = _scoped_job(session, principal, job_id, lock=True)
    _, hard = settings.job_time_limits(current.options.tuning_budget_s)
    job = repo.start_job(
        session, job_id=job_id, worker=claim.worker, instance=claim.instance, pid=claim.pid,
        max_attempts=settings.max_job_attempts, count_attempt=not claim.resume,
        deadline=utcnow() + timedelta(seconds=hard + settings.job_kill_grace_s),
        redelivered=claim.redelivered,
        pid_alive=lambda pid: claim.dead_pid is None or pid != claim.dead_pid)
    if job is None:
        after = repo.get_job(session, job_id=job_id)
        session.commit()  # a job failed past its attempt limit stays failed
        if after.status.terminal:
            why = f"it is {after.status.value}"
        else:
            why = (f"it runs on {after.worker} (instance {after.worker_instance}, pid "
                   f"{after.worker_pid}), which is alive")
        raise ClaimRefused(
            f"compile job {job_id} cannot be claimed by {claim.worker} (pid {claim.pid}): "
            f"{why}; this delivery builds nothing", job_id=job_id,
            status=after.status.value, terminal=after.status.terminal,
            owner=after.worker, owner_instance=after.worker_instance,
            owner_pid=after.worker_pid, attempts=after.attempts,
            error=after.error.model_dump(mode="json") if after.error else None)
    session.commit()
    return ClaimedJob(job=job, max_attempts=settings.max_job_attempts,
                      lease=claim_lease(settings.secret_key, job_id, claim.instance))


@router.post("/{job_id}/release", response_model=JobReleased)
def release_job(release: JobRelease, session: SessionDep, principal: WorkerPrincipal,
                job_id: str) -> JobReleased:
    """Give a running job back to the queue (``queued``) before its task is retried; only its
    owner instance may (``released`` false otherwise)."""
    _scoped_job(session, principal, job_id)
    released = repo.release_job(session, job_id=job_id, instance=release.instance)
    session.commit()
    return JobReleased(released=released)


@router.post("/{job_id}/stage", response_model=CompileJob,
             responses={409: {"description": "`cancelled`: an operator cancelled the job; "
                                             "the worker stops building"}})
def report_stage(report: StageReport, session: SessionDep, principal: WorkerPrincipal,
                 job_id: str) -> CompileJob:
    """Record the build's stage and progress. A cancelled job answers 409 ``cancelled``; a
    finished one is left as it is."""
    _scoped_job(session, principal, job_id)
    repo.set_job_stage(session, job_id=job_id, stage=report.stage, progress=report.progress)
    session.commit()
    return repo.get_job(session, job_id=job_id)


@router.post("/{job_id}/fail", response_model=CompileJob)
def fail_job(error: ErrorBody, session: SessionDep, principal: WorkerPrincipal,
             job_id: str) -> CompileJob:
    """Fail the job with a typed reason (a job already failed or cancelled keeps its own;
    one that succeeded is 409)."""
    _scoped_job(session, principal, job_id)
    failed = repo.fail_job(session, job_id=job_id, error=_without_nul(error))
    session.commit()
    return failed


def _without_nul(error: ErrorBody) -> ErrorBody:
    """``error`` with each NUL in its text written ``\\x00``: a build's message may quote
    what a model holds, the database refuses NUL in text (``services/db/session.py``), and
    the job must still fail with its typed reason."""

    def clean(value: Any) -> Any:
        if isinstance(value, str):
            return value.replace("\x00", "\\x00")
        if isinstance(value, dict):
            return {clean(k): clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    return ErrorBody(code=error.code, message=clean(error.message),
                     details=clean(error.details))


@router.post("/{job_id}/cache", response_model=CacheAnswer)
def cache_lookup(query: CacheQuery, http: Request, session: SessionDep, store: StoreDep,
                 principal: WorkerPrincipal, job_id: str) -> CacheAnswer:
    """Is there already an artifact for this running job's cache key (model, options digest,
    fingerprint key, ``toolchain``)? Only one whose manifest and blobs are all in the store is
    a hit: the job then succeeds as a cache hit. One that lost a part is marked ``broken`` (and
    its stale manifest removed), and the worker builds it again; a forced rebuild never hits.
    Otherwise the tuning record of the same key comes back, for the tuner to reuse."""
    job = _building_job(session, principal, job_id)
    if not job.force:
        cached = repo.find_artifact(session, model_id=job.model_id,
                                    options_digest=job.options_digest,
                                    fingerprint_key=job.fingerprint_key,
                                    toolchain=query.toolchain)
        if cached is not None and usable_artifact(session, store, cached.id):
            done = repo.succeed_job(session, job_id=job_id, artifact_id=cached.id,
                                    cache_hit=True)
            session.commit()
            http.app.state.desired_hub.models_changed({job.model_id})
            logger.info("job %s: cache hit, artifact %s", job_id, cached.id)
            return CacheAnswer(artifact_id=cached.id, job=done)
        session.commit()  # an artifact found broken stays so
    tuning = repo.find_tuning(session, model_id=job.model_id, options_digest=job.options_digest,
                              fingerprint_key=job.fingerprint_key, toolchain=query.toolchain)
    return CacheAnswer(job=job, tuning=tuning)


def _stream(store: ArtifactStore, ref: BlobRef) -> StreamingResponse:
    return StreamingResponse(store.open_blob(ref), media_type="application/octet-stream",
                             headers={"Content-Length": str(ref.size),
                                      "X-Kiln-SHA256": ref.sha256})


_BYTES = {200: {"content": {"application/octet-stream": {}}, "description": "the bytes, "
                "with their sha256 in `X-Kiln-SHA256`"}}


@router.get("/{job_id}/model", response_class=StreamingResponse, responses=_BYTES)
def job_model(session: SessionDep, store: StoreDep, principal: WorkerPrincipal,
              job_id: str) -> StreamingResponse:
    """The running job's model as submitted (an ONNX model, a model archive or a ``.pt2``),
    streamed from the store."""
    job = _building_job(session, principal, job_id)
    model = repo.get_model(session, model_id=job.model_id)
    session.rollback()  # no transaction held open while the bytes stream
    return _stream(store, BlobRef(name="model", sha256=model.sha256, size=model.size_bytes))


@router.get("/{job_id}/datasets/{dataset_id}", response_class=StreamingResponse,
            responses=_BYTES)
def job_dataset(session: SessionDep, store: StoreDep, principal: WorkerPrincipal,
                job_id: str, dataset_id: str) -> StreamingResponse:
    """A dataset the running job's options name (``samples`` or ``calibration``), streamed."""
    job = _building_job(session, principal, job_id)
    named = {job.options.samples, job.options.calibration} - {None}
    if dataset_id not in named:
        raise NotFound(f"compile job {job_id} names no dataset {dataset_id}; its options name "
                       f"{sorted(named) or 'none'}", job_id=job_id, dataset=dataset_id)
    dataset = repo.get_dataset(session, dataset_id=dataset_id)
    if dataset is None:
        raise NotFound(f"dataset {dataset_id} of compile job {job_id} does not exist; push it "
                       f"with `kiln dataset push FILE.npz`", dataset=dataset_id)
    session.rollback()
    return _stream(store, BlobRef(name="dataset", sha256=dataset.id, size=dataset.size_bytes))


@router.post("/{job_id}/plugins", response_model=list[PluginInfo])
def job_plugins(query: PluginQuery, session: SessionDep, principal: WorkerPrincipal,
                job_id: str) -> list[PluginInfo]:
    """The newest registered plugin providing each of the model's custom ops, once each; an op
    that no plugin declares is 422 ``unknown_operator`` naming what is registered."""
    _building_job(session, principal, job_id)
    ops = set(query.ops)
    providers = repo.plugins_for_ops(session, ops=ops)
    missing = sorted(ops - set(providers))
    if missing:
        registered = {p.name: p.ops for p in repo.list_plugins(session)}
        raise UnknownOperator(
            f"the model uses {missing}, which no registered plugin provides; registered "
            f"plugins: {registered or 'none'} (push one with `kiln plugin push`)",
            missing=missing)
    return list({p.digest: p for p in providers.values()}.values())


@router.get("/{job_id}/plugins/{digest}", response_class=StreamingResponse, responses=_BYTES)
def job_plugin_bundle(session: SessionDep, store: StoreDep, principal: WorkerPrincipal,
                      job_id: str, digest: str) -> StreamingResponse:
    """A registered plugin bundle, by digest, streamed."""
    _building_job(session, principal, job_id)
    found = next((p for p in repo.list_plugins(session) if p.digest == digest), None)
    if found is None:
        raise NotFound(f"no registered plugin has digest {digest}", digest=digest)
    session.rollback()
    return _stream(store, BlobRef(name="plugin", sha256=found.digest, size=found.size_bytes))

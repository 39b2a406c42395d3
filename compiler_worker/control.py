"""The compiler worker's HTTP client of the control plane's build routes: the worker's only
way to the control plane (it holds no database URL and no store credentials).

=====================================  ==========================================
``heartbeat(name, beat)``              ``PUT /v1/builds/workers/{name}``
``claim(job_id, claim)``               ``POST /v1/builds/{job_id}/claim`` → ``ClaimedJob``;
                                       ``ClaimRefused`` when it cannot be given
``release(job_id, instance)``          ``POST /v1/builds/{job_id}/release``
``stage(job_id, stage, progress)``     ``POST /v1/builds/{job_id}/stage``; ``JobCancelled``
``fail(job_id, error)``                ``POST /v1/builds/{job_id}/fail``
``cache(job_id, toolchain)``           ``POST /v1/builds/{job_id}/cache`` → ``CacheAnswer``
``model(job_id)``                      ``GET /v1/builds/{job_id}/model``: bytes, checked
``dataset(job_id, dataset_id)``        ``GET /v1/builds/{job_id}/datasets/{id}``: bytes,
                                       checked against the id
``plugins(job_id, ops)``               ``POST /v1/builds/{job_id}/plugins`` → ``PluginInfo``s
``plugin_bundle(job_id, info, dest)``  ``GET /v1/builds/{job_id}/plugins/{digest}``: a file,
                                       checked against the digest
``upload_blob(job_id, path, ref)``     ``PUT /v1/builds/{job_id}/blobs/{name}``: the file,
                                       streamed, with the sha256 the worker computed
``complete(job_id, manifest)``         ``POST /v1/builds/{job_id}/complete``: the control
                                       plane re-hashes, signs, records → ``BuildPublished``
``ping()``                             ``GET /healthz``: the API answers (``/readyz``)
=====================================  ==========================================

Authenticated by a worker token (``KILN_WORKER_TOKEN``) scoped to this machine's fingerprint
keys. Error responses are raised as the ``KilnError`` their body names (``ClaimRefused`` and
``JobCancelled`` by their own types); an unreachable control plane
(``api_unreachable``) and retryable statuses (500, 502, 503, 504, ...) as transient errors,
which the job retries.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from runtime_agent.errors import ControlPlaneUnreachable, error_from_response
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
    ConfigError,
    ErrorBody,
    ErrorCode,
    IntegrityError,
    JobCancelled,
    KilnError,
)
from schemas.jobs import CompileJob, JobStage
from schemas.manifest import ArtifactManifest, BlobRef
from schemas.plugins import PluginInfo
from schemas.workers import WorkerInfo

logger = logging.getLogger(__name__)

_CHUNK = 1024 * 1024
#: Seconds a small call (a heartbeat, a stage, a claim) may take before it counts as failed.
SHORT_TIMEOUT_S = 10.0
#: Error codes raised as their own ``KilnError`` subclass, which callers catch by type.
_TYPED: dict[ErrorCode, type[KilnError]] = {ErrorCode.CLAIM_REFUSED: ClaimRefused,
                                            ErrorCode.CANCELLED: JobCancelled}


def _typed(error: KilnError) -> KilnError:
    cls = _TYPED.get(error.code)
    if cls is None or isinstance(error, cls):
        return error
    typed = cls(error.message, **error.details)
    typed.transient = error.transient
    return typed


def _file_chunks(path: Path) -> Iterator[bytes]:
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            yield chunk


class BuildClient:
    """A client of the control plane's worker-facing routes."""

    def __init__(self, api_url: str | None, token: str | None, *,
                 timeout_s: float = 300.0, http: httpx.Client | None = None) -> None:
        """``http``: a client to use instead of a new one (it must send the token)."""
        if not api_url or not token:
            raise ConfigError(
                "a compiler worker publishes through the control plane: set "
                "KILN_WORKER_API_URL (the API's URL) and KILN_WORKER_TOKEN (a worker token "
                "for this machine's fingerprint keys: `kiln token create --role worker --key "
                "KEY`)", api_url=api_url, token_set=bool(token))
        self.api_url = api_url.rstrip("/")
        self.http = http or httpx.Client(base_url=self.api_url, timeout=timeout_s,
                                         headers={"Authorization": f"Bearer {token}"})
        #: job id → the lease its claim answered: uploads and the publish present it, since
        #: the control plane lets only the claiming instance write into a job.
        self._leases: dict[str, str] = {}

    def _claim_headers(self, job_id: str) -> dict[str, str]:
        lease = self._leases.get(job_id)
        return {"X-Kiln-Claim": lease} if lease else {}

    def close(self) -> None:
        self.http.close()

    def _unreachable(self, method: str, path: str, exc: Exception) -> KilnError:
        return ControlPlaneUnreachable(
            f"cannot reach the control plane at {self.api_url} ({method} {path}): "
            f"{type(exc).__name__}: {exc}", code=ErrorCode.API_UNREACHABLE,
            api_url=self.api_url)

    def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise self._unreachable(method, path, exc) from exc
        if response.status_code >= 400:
            raise _typed(error_from_response(response, f"{method} {path}"))
        return response

    def _json(self, method: str, path: str, body: Any = None, *,
              timeout_s: float | None = SHORT_TIMEOUT_S) -> httpx.Response:
        kwargs: dict[str, Any] = {"timeout": timeout_s}
        if body is not None:
            kwargs["content"] = body.model_dump_json()
            kwargs["headers"] = {"Content-Type": "application/json"}
        return self._call(method, path, **kwargs)

    def _download(self, path: str, dest: Path, sha256: str, what: str) -> Path:
        """Stream ``path`` into ``dest``; ``IntegrityError`` unless it hashes to ``sha256``."""
        digest = hashlib.sha256()
        tmp = dest.with_name(dest.name + ".part")
        try:
            with self.http.stream("GET", path) as response:
                if response.status_code >= 400:
                    response.read()
                    raise _typed(error_from_response(response, f"GET {path}"))
                with tmp.open("wb") as out:
                    for chunk in response.iter_bytes(_CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
        except httpx.TransportError as exc:
            tmp.unlink(missing_ok=True)
            raise self._unreachable("GET", path, exc) from exc
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if digest.hexdigest() != sha256:
            tmp.unlink(missing_ok=True)
            raise IntegrityError(f"{what} came with sha256 {digest.hexdigest()}, not its "
                                 f"{sha256}", expected_sha256=sha256,
                                 actual_sha256=digest.hexdigest())
        os.replace(tmp, dest)
        return dest

    def ping(self) -> None:
        """Raise unless the control plane answers ``/healthz`` (the worker's ``/readyz``)."""
        self._json("GET", "/healthz", timeout_s=3.0)

    def heartbeat(self, name: str, beat: WorkerHeartbeat) -> WorkerInfo:
        response = self._json("PUT", f"/v1/builds/workers/{quote(name, safe='')}", beat)
        return WorkerInfo.model_validate_json(response.content)

    def claim(self, job_id: str, claim: BuildClaim) -> ClaimedJob:
        """The job, now running under this worker process; ``ClaimRefused`` when the control
        plane will not give it (``details``: its ``status``, ``terminal``, its owner)."""
        response = self._json("POST", f"/v1/builds/{quote(job_id, safe='')}/claim", claim)
        claimed = ClaimedJob.model_validate_json(response.content)
        if claimed.lease:
            self._leases[job_id] = claimed.lease
        return claimed

    def release(self, job_id: str, instance: str) -> bool:
        response = self._json("POST", f"/v1/builds/{quote(job_id, safe='')}/release",
                              JobRelease(instance=instance))
        return JobReleased.model_validate_json(response.content).released

    def stage(self, job_id: str, stage: JobStage, progress: float) -> None:
        """Report progress; ``JobCancelled`` once an operator cancelled the job."""
        self._json("POST", f"/v1/builds/{quote(job_id, safe='')}/stage",
                   StageReport(stage=stage, progress=progress))

    def fail(self, job_id: str, error: ErrorBody) -> CompileJob:
        response = self._json("POST", f"/v1/builds/{quote(job_id, safe='')}/fail", error)
        return CompileJob.model_validate_json(response.content)

    def cache(self, job_id: str, toolchain: str) -> CacheAnswer:
        """A hit (the job then succeeded) only for an artifact whole in the store; otherwise
        the tuning record of the same key, if any."""
        response = self._json("POST", f"/v1/builds/{quote(job_id, safe='')}/cache",
                              CacheQuery(toolchain=toolchain), timeout_s=120.0)
        return CacheAnswer.model_validate_json(response.content)

    def model(self, job_id: str, model_id: str, dest: Path) -> Path:
        """The job's model as submitted, in ``dest``, checked against its id (its sha256)."""
        return self._download(f"/v1/builds/{quote(job_id, safe='')}/model", dest, model_id,
                              f"model {model_id}")

    def dataset(self, job_id: str, dataset_id: str, dest: Path) -> Path:
        """A dataset the job names, in ``dest``, checked against its id (its sha256)."""
        return self._download(
            f"/v1/builds/{quote(job_id, safe='')}/datasets/{quote(dataset_id, safe='')}",
            dest, dataset_id, f"dataset {dataset_id}")

    def plugins(self, job_id: str, ops: set[str]) -> list[PluginInfo]:
        """The plugins providing ``ops``; ``UnknownOperator`` (422) naming those no plugin
        declares."""
        response = self._json("POST", f"/v1/builds/{quote(job_id, safe='')}/plugins",
                              PluginQuery(ops=sorted(ops)))
        return [PluginInfo.model_validate(item) for item in response.json()]

    def plugin_bundle(self, job_id: str, info: PluginInfo, dest: Path) -> Path:
        return self._download(
            f"/v1/builds/{quote(job_id, safe='')}/plugins/{quote(info.digest, safe='')}",
            dest, info.digest, f"plugin {info.name} {info.version}")

    def upload_blob(self, job_id: str, path: Path, ref: BlobRef) -> BlobRef:
        """Stream ``path`` to the control plane as blob ``ref.name`` of ``job_id``; the
        control plane refuses bytes that do not hash to ``ref.sha256``."""
        response = self._call(
            "PUT", f"/v1/builds/{quote(job_id, safe='')}/blobs/{quote(ref.name, safe='')}",
            params={"media_type": ref.media_type},
            headers={"X-Kiln-Sha256": ref.sha256, "Content-Length": str(path.stat().st_size),
                     "Content-Type": "application/octet-stream",
                     **self._claim_headers(job_id)},
            content=_file_chunks(path))
        stored = BlobRef.model_validate_json(response.content)
        if stored.sha256 != ref.sha256 or stored.size != ref.size:
            raise IntegrityError(f"blob {ref.name} was stored as {stored.sha256} "
                                 f"({stored.size} bytes); the build made {ref.sha256} "
                                 f"({ref.size} bytes)", blob=ref.name)
        return stored

    def complete(self, job_id: str, manifest: ArtifactManifest, *,
                 replace: bool = False) -> BuildPublished:
        """Ask the control plane to re-hash, sign and record the build."""
        body = BuildCompletion(manifest=manifest.model_copy(update={"signature": None}),
                               replace=replace)
        response = self._call("POST", f"/v1/builds/{quote(job_id, safe='')}/complete",
                              content=body.model_dump_json(),
                              headers={"Content-Type": "application/json",
                                       **self._claim_headers(job_id)})
        self._leases.pop(job_id, None)  # published: nothing more is written into it
        return BuildPublished.model_validate_json(response.content)

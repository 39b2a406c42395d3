"""The Python SDK: a thin, typed client of the Kiln HTTP API."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel

from runtime_agent.errors import error_from_response
from schemas.agents import AgentInfo, ModelState
from schemas.datasets import DatasetInfo
from schemas.deployments import Deployment
from schemas.errors import ErrorBody, ErrorCode, InvalidRequest, KilnError
from schemas.jobs import CompileJob, JobStatus
from schemas.manifest import ArtifactManifest, ArtifactSummary, BlobRef
from schemas.models import ModelInfo
from schemas.options import CompileOptions, Precision
from schemas.retention import RetentionReport
from schemas.rollouts import Rollout
from schemas.tuning import TuningTable


class KilnClient:
    def __init__(self, api_url: str, token: str | None, *, timeout: float = 60.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.api_url = api_url.rstrip("/")
        self.http = httpx.Client(base_url=self.api_url, headers=headers, timeout=timeout)

    @classmethod
    def from_env(cls, api_url: str | None = None, token: str | None = None) -> KilnClient:
        from kiln.config import ClientSettings

        default_url, default_token = ClientSettings().resolved()
        return cls(api_url or default_url, token or default_token)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> KilnClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            error = KilnError(f"cannot reach the Kiln API at {self.api_url}: {exc}",
                              code=ErrorCode.API_UNREACHABLE)
            error.transient = True
            raise error from exc
        if response.status_code >= 400:
            raise error_from_response(response, f"{method} {path}")
        return response

    # tokens
    def revoke_token(self, jti: str, *, reason: str = "") -> dict[str, Any]:
        """Revoke the token whose ``jti`` this is (admin)."""
        return self._call("POST", "/v1/tokens/revoked",
                          json={"jti": jti, "reason": reason}).json()

    # models
    def upload_model(self, model: Path | bytes, *, name: str | None = None) -> ModelInfo:
        """Upload a model: ``.onnx`` bytes, or a path to a ``.onnx`` (sent together with the
        external data files it references, found beside it and streamed) or to a model
        archive (tar)."""
        form = {"name": name} if name else {}
        if not isinstance(model, Path):
            files = [("file", ("model.onnx", model, "application/octet-stream"))]
            response = self._call("POST", "/v1/models", files=files, data=form)
            return ModelInfo.model_validate(response.json())
        from contextlib import ExitStack

        from kiln.model_files import model_files

        with ExitStack() as stack:
            files = [("file", (location, stack.enter_context(path.open("rb")),
                               "application/octet-stream"))
                     for location, path in model_files(model).items()]
            response = self._call("POST", "/v1/models", files=files, data=form)
        return ModelInfo.model_validate(response.json())

    def get_model(self, model_id: str) -> ModelInfo:
        return ModelInfo.model_validate(self._call("GET", f"/v1/models/{model_id}").json())

    # datasets
    def push_dataset(self, path: Path | bytes) -> DatasetInfo:
        """Upload an ``.npz`` of sample inputs (one array per model input, first axis = the
        sample index); the same bytes return the same dataset."""
        data = path.read_bytes() if isinstance(path, Path) else path
        filename = path.name if isinstance(path, Path) else "samples.npz"
        files = {"file": (filename, data, "application/x-npz")}
        return DatasetInfo.model_validate(self._call("POST", "/v1/datasets", files=files).json())

    def list_datasets(self, *, limit: int = 100) -> list[DatasetInfo]:
        response = self._call("GET", "/v1/datasets", params={"limit": limit})
        return [DatasetInfo.model_validate(d) for d in response.json()]

    def get_dataset(self, dataset_id: str) -> DatasetInfo:
        return DatasetInfo.model_validate(self._call("GET", f"/v1/datasets/{dataset_id}").json())

    # jobs
    def create_jobs(
        self, model_id: str, targets: Iterable[str], options: CompileOptions | None = None
    ) -> list[CompileJob]:
        payload = {
            "model_id": model_id,
            "options": (options or CompileOptions()).model_dump(mode="json"),
            "targets": [{"fingerprint_key": key} for key in targets],
        }
        response = self._call("POST", "/v1/compile-jobs", json=payload)
        return [CompileJob.model_validate(j) for j in response.json()["jobs"]]

    def get_job(self, job_id: str) -> CompileJob:
        return CompileJob.model_validate(self._call("GET", f"/v1/compile-jobs/{job_id}").json())

    def list_jobs(self, **filters: Any) -> list[CompileJob]:
        params = {k: v for k, v in filters.items() if v is not None}
        response = self._call("GET", "/v1/compile-jobs", params=params)
        return [CompileJob.model_validate(j) for j in response.json()]

    def cancel_job(self, job_id: str) -> CompileJob:
        """Cancel a queued, waiting or running job (``Conflict`` once it finished)."""
        return CompileJob.model_validate(
            self._call("POST", f"/v1/compile-jobs/{job_id}/cancel").json())

    def retry_job(self, job_id: str) -> CompileJob:
        """Queue a failed or cancelled job again (idempotent)."""
        return CompileJob.model_validate(
            self._call("POST", f"/v1/compile-jobs/{job_id}/retry").json())

    def rebuild(self, model_id: str, fingerprint_key: str,
                options: CompileOptions | None = None) -> CompileJob:
        """Force a fresh build of the model for one fingerprint key, ignoring the cache."""
        payload = {"fingerprint_key": fingerprint_key,
                   "options": (options or CompileOptions()).model_dump(mode="json")}
        return CompileJob.model_validate(
            self._call("POST", f"/v1/models/{model_id}/rebuild", json=payload).json())

    def wait_job(
        self,
        job_id: str,
        *,
        timeout_s: float = 1800,
        poll_s: float = 0.25,
        on_update: Callable[[CompileJob], None] | None = None,
        on_retry: Callable[[KilnError, float], None] | None = None,
        max_backoff_s: float = 10.0,
    ) -> CompileJob:
        """Poll a job until it finishes. An API that is restarting (connection refused, 502,
        503, 504) is waited out with exponential backoff up to ``max_backoff_s``, each wait
        reported to ``on_retry(error, delay)``; the deadline still holds."""
        deadline = time.monotonic() + timeout_s
        backoff = poll_s
        while True:
            try:
                job = self.get_job(job_id)
            except KilnError as exc:
                if not exc.transient:
                    raise
                delay = min(backoff, max_backoff_s, max(deadline - time.monotonic(), 0))
                if delay <= 0:
                    raise KilnError(f"job {job_id}: the API stayed unavailable until the "
                                    f"{timeout_s:g} s deadline: {exc.message}",
                                    code=exc.code) from exc
                if on_retry is not None:
                    on_retry(exc, delay)
                time.sleep(delay)
                backoff = min(backoff * 2, max_backoff_s)
                continue
            backoff = poll_s
            if on_update is not None:
                on_update(job)
            if job.status.terminal:
                return job
            if time.monotonic() > deadline:
                raise KilnError(f"job {job_id} is still {job.status} after {timeout_s}s",
                                code=ErrorCode.TIMED_OUT)
            time.sleep(poll_s)

    # artifacts
    def list_artifacts(self, **filters: Any) -> list[ArtifactSummary]:
        params = {k: v for k, v in filters.items() if v is not None}
        response = self._call("GET", "/v1/artifacts", params=params)
        return [ArtifactSummary.model_validate(a) for a in response.json()]

    def get_artifact(self, artifact_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/artifacts/{artifact_id}").json()

    def delete_artifact(self, artifact_id: str, *, force: bool = False) -> dict[str, Any]:
        """Delete an artifact and the blobs nothing else uses (``Conflict`` while deployed,
        unless ``force``)."""
        return self._call("DELETE", f"/v1/artifacts/{artifact_id}",
                          params={"force": force}).json()

    def collect_garbage(self, *, dry_run: bool = False) -> RetentionReport:
        """Apply the retention policy now (``dry_run``: only say what it would delete)."""
        response = self._call("POST", "/v1/gc", params={"dry_run": dry_run})
        return RetentionReport.model_validate(response.json())

    def list_models(self, *, limit: int = 100) -> list[ModelInfo]:
        response = self._call("GET", "/v1/models", params={"limit": limit})
        return [ModelInfo.model_validate(m) for m in response.json()]

    def get_manifest(self, artifact_id: str) -> ArtifactManifest:
        return ArtifactManifest.model_validate(self.get_artifact(artifact_id)["manifest"])

    def get_signed_manifest(self, artifact_id: str) -> bytes:
        """The artifact's manifest exactly as stored: a signed envelope, to verify with
        ``artifact_store.signing.Verifier.verify_manifest``."""
        return self._call("GET", f"/v1/artifacts/{artifact_id}/manifest").content

    def download_blob(self, artifact_id: str, ref: BlobRef, dest: Path) -> Path:
        """Download blob ``ref`` of an artifact to ``dest``: resumable, following a presigned
        redirect without credentials, size and sha256 verified (the agent's download path)."""
        from runtime_agent.download import download  # the signing stack: only for downloads

        return download(self.http, f"/v1/artifacts/{artifact_id}/blobs/{ref.name}", dest,
                        size=ref.size, sha256=ref.sha256)

    # tuning
    def tuning(self, artifact_or_model_id: str) -> list[TuningTable]:
        """The tuner's candidate tables: the one behind an artifact, or, for a model id, one
        per tuning record of that model (per fingerprint key, toolchain and options), newest
        first. ``NotFound`` when the id is neither, or the artifact has no table."""
        try:
            self.get_model(artifact_or_model_id)
        except KilnError as exc:
            if exc.code is not ErrorCode.NOT_FOUND:
                raise
        else:
            response = self._call("GET", "/v1/tuning", params={"model_id": artifact_or_model_id})
            return [TuningTable.model_validate(r["table"]) for r in response.json()]
        response = self._call("GET", f"/v1/artifacts/{artifact_or_model_id}/tuning")
        return [TuningTable.model_validate(response.json())]

    # plugins
    def push_plugin(self, archive: Path) -> dict[str, Any]:
        """Register a bundle archive (``kiln plugin build``)."""
        files = {"file": (archive.name, archive.read_bytes(), "application/x-tar")}
        return self._call("POST", "/v1/plugins", files=files).json()

    def list_plugins(self) -> list[dict[str, Any]]:
        return self._call("GET", "/v1/plugins").json()

    # fleet
    def deploy(
        self, name: str, model_id: str, *, selector: dict[str, str] | None = None,
        options: CompileOptions | None = None, rollout: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Create or update deployment ``name``; returns the deployment, its build jobs and
        the rollout a change with ``rollout`` (a ``RolloutPolicy`` body) started."""
        payload = {
            "name": name, "model_id": model_id, "selector": selector or {},
            "options": (options or CompileOptions()).model_dump(mode="json"),
            "rollout": rollout,
        }
        return self._call("POST", "/v1/deployments", json=payload).json()

    def built_options(self, model_id: str) -> CompileOptions | None:
        """The options of the model's latest successful build (``None`` when it has none):
        what a deployment of it should ask for to serve that engine rather than queue
        another."""
        for job in self.list_jobs(model_id=model_id, status=JobStatus.SUCCEEDED.value,
                                  limit=1):
            return job.options
        return None

    def list_deployments(self) -> list[dict[str, Any]]:
        return self._call("GET", "/v1/deployments").json()

    def delete_deployment(self, name: str) -> None:
        self._call("DELETE", f"/v1/deployments/{name}")

    def list_rollouts(self, *, active: bool = False) -> list[dict[str, Any]]:
        return self._call("GET", "/v1/rollouts", params={"active": active}).json()

    def rollout_action(self, ref: str, action: str) -> dict[str, Any]:
        """``pause``, ``resume`` or ``abort`` rollout ``ref`` (an id or a deployment name)."""
        return self._call("POST", f"/v1/rollouts/{ref}/{action}").json()

    def list_agents(self) -> list[dict[str, Any]]:
        return self._call("GET", "/v1/agents").json()

    def get_agent(self, name: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/agents/{name}").json()

    def fleet(self) -> dict[str, Any]:
        return self._call("GET", "/v1/fleet").json()

    def list_workers(self) -> list[dict[str, Any]]:
        return self._call("GET", "/v1/workers").json()

    def live_fingerprint_keys(self, model_format: str | None = None, *,
                              backends: Iterable[str] = ()) -> list[str]:
        """The fingerprint keys that a live compiler worker serves right now, as a request that
        names no key targets them; with ``model_format``, only those whose workers build models
        of that format. The key of a backend whose candidates race in another backend's job
        on the worker (``Executor.joins_as_peer``: OpenVINO beside onnxruntime) is left out
        unless ``backends`` names it, so that a request does not build twice; so is a
        worker's tuning-context key (``K-t-…``), which only a node of that context needs."""
        from runtime_agent.executors import node_fingerprint_keys, peer_backends
        from schemas.fingerprint import HardwareFingerprint, is_context_key_of

        skip = peer_backends() - set(backends)
        keys = set()
        for worker in self.list_workers():
            if not worker["alive"]:
                continue
            formats = worker.get("model_formats") or {}
            peers: set[str] = set()
            if skip and worker.get("fingerprint"):
                derived = node_fingerprint_keys(
                    HardwareFingerprint.model_validate(worker["fingerprint"]))
                peers = {key for backend, key in derived.items() if backend in skip}
            own = worker["fingerprint_keys"]
            keys |= {k for k in own if k not in peers and (
                model_format is None or k not in formats or model_format in formats[k])
                and not any(is_context_key_of(k, plain) for plain in own)}
        return sorted(keys)

    def health(self) -> dict[str, Any]:
        return self._call("GET", "/healthz").json()


# ---------------------------------------------------------------- the one-call SDK
class DeploymentApplied(BaseModel):
    """What ``POST /v1/deployments`` answers: the deployment, the compile jobs it queued for
    the agents it selects that have no engine yet, and the rollout it started (if any)."""

    deployment: Deployment
    build_jobs: list[str]
    rollout: Rollout | None = None


class Job:
    """One submission of a model: a compile job per target fingerprint key (``jobs``).
    ``wait()`` waits for them and returns the engine's manifest."""

    def __init__(self, client: KilnClient, model: ModelInfo, jobs: list[CompileJob]) -> None:
        self.client = client
        self.model = model
        self.jobs = jobs

    def __repr__(self) -> str:
        states = ", ".join(f"{j.fingerprint_key}: {j.status.value}" for j in self.jobs)
        return f"<kiln.Job model {self.model.id[:12]} ({states})>"

    @property
    def ids(self) -> list[str]:
        return [j.id for j in self.jobs]

    def refresh(self) -> list[CompileJob]:
        """Read every job's state again."""
        self.jobs = [self.client.get_job(j.id) for j in self.jobs]
        return self.jobs

    def wait_all(self, timeout_s: float = 1800, *,
                 on_update: Callable[[CompileJob], None] | None = None) -> list[ArtifactManifest]:
        """Wait for every job; the manifest of each target's engine, in the order of
        ``jobs``. A job that did not succeed raises its typed error (its code and message as
        the build reported them), naming the job and its key."""
        deadline = time.monotonic() + timeout_s
        finished = [self.client.wait_job(j.id, timeout_s=max(deadline - time.monotonic(), 0),
                                         on_update=on_update) for j in self.jobs]
        self.jobs = finished
        for job in finished:
            if job.status is not JobStatus.SUCCEEDED:
                body = job.error or ErrorBody(
                    code=ErrorCode.CANCELLED if job.status is JobStatus.CANCELLED
                    else ErrorCode.BUILD_FAILED, message=f"the job ended {job.status.value}")
                raise KilnError(f"job {job.id} for {job.fingerprint_key} "
                                f"{job.status.value}: {body.message}", code=body.code,
                                job_id=job.id, fingerprint_key=job.fingerprint_key)
        return [self.client.get_manifest(j.artifact_id or "") for j in finished]

    def wait(self, timeout_s: float = 1800, *,
             on_update: Callable[[CompileJob], None] | None = None) -> ArtifactManifest:
        """Wait for the job and return its engine's manifest. A submission to several
        fingerprint keys has several engines: ``wait_all()`` returns them."""
        if len(self.jobs) != 1:
            raise InvalidRequest(
                f"this submission built for {len(self.jobs)} fingerprint keys "
                f"({[j.fingerprint_key for j in self.jobs]}); call wait_all() for their "
                f"artifacts, or submit with one target", keys=[j.fingerprint_key
                                                               for j in self.jobs])
        return self.wait_all(timeout_s, on_update=on_update)[0]


class DeploymentHandle:
    """A deployment as applied: ``wait()`` returns once every live agent it selects serves
    the engine built for it."""

    def __init__(self, client: KilnClient, applied: DeploymentApplied) -> None:
        self.client = client
        self.applied = applied

    def __repr__(self) -> str:
        d = self.deployment
        return f"<kiln.Deployment {d.name} generation {d.generation} model {d.model_id[:12]}>"

    @property
    def deployment(self) -> Deployment:
        return self.applied.deployment

    @property
    def name(self) -> str:
        return self.applied.deployment.name

    def status(self) -> list[AgentServing]:
        """Each live agent the deployment selects, and what it serves of it."""
        return deployment_status(self.client, self.deployment)

    def wait(self, timeout_s: float = 600, *, poll_s: float = 0.5,
             on_update: Callable[[list[AgentServing]], None] | None = None,
             ) -> list[AgentServing]:
        """Wait until the builds it queued finished and every live agent it selects serves
        its engine for this generation (state ``serving``, nothing pending, not the
        fallback tier while a build for it runs). A failed build raises its typed error; an
        agent that reports a failure raises it, naming the agent. With no agent selected,
        returns at once (nothing to serve)."""
        deadline = time.monotonic() + timeout_s
        for job_id in self.applied.build_jobs:
            job = self.client.wait_job(job_id, timeout_s=max(deadline - time.monotonic(), 0))
            if job.status is not JobStatus.SUCCEEDED:
                body = job.error or ErrorBody(code=ErrorCode.BUILD_FAILED,
                                              message=f"the job ended {job.status.value}")
                raise KilnError(f"deployment {self.name}: build {job.id} for "
                                f"{job.fingerprint_key} {job.status.value}: {body.message}",
                                code=body.code, job_id=job.id)
        while True:
            agents = self.status()
            if on_update is not None:
                on_update(agents)
            for agent in agents:
                if agent.state == ModelState.FAILED.value and agent.error is not None:
                    raise KilnError(f"deployment {self.name}: agent {agent.agent} failed to "
                                    f"load its engine: {agent.error.message}",
                                    code=agent.error.code, agent=agent.agent)
            if all(a.ready for a in agents):
                return agents
            if time.monotonic() > deadline:
                waiting = [f"{a.agent} ({a.state or 'nothing reported'})"
                           for a in agents if not a.ready]
                raise KilnError(f"deployment {self.name}: after {timeout_s:g} s, agents "
                                f"not serving yet: {', '.join(waiting)}",
                                code=ErrorCode.TIMED_OUT, agents=waiting)
            time.sleep(poll_s)


class AgentServing(BaseModel):
    """One selected agent and what it reports of a deployment."""

    agent: str
    alive: bool
    #: ``ModelState`` as the agent reported it; ``None`` before it reported this deployment.
    state: str | None = None
    artifact_id: str | None = None
    tier: str | None = None
    error: ErrorBody | None = None
    #: Serving, with nothing pending, and not a fallback while its own build runs.
    ready: bool = False


def deployment_status(client: KilnClient, deployment: Deployment) -> list[AgentServing]:
    """Every live agent ``deployment`` selects, with what it reports of it."""
    rows = []
    for record in client.list_agents():
        info = AgentInfo.model_validate(record)
        if not info.alive or not deployment.selects(info.labels):
            continue
        status = next((m for m in info.models if m.deployment == deployment.name), None)
        if status is None:
            rows.append(AgentServing(agent=info.name, alive=True))
            continue
        ready = (status.state is ModelState.SERVING and status.target_artifact_id is None
                 and status.artifact_id is not None and status.tier != "fallback")
        rows.append(AgentServing(agent=info.name, alive=True, state=status.state.value,
                                 artifact_id=status.artifact_id, tier=status.tier,
                                 error=status.error, ready=ready))
    return rows


class Client:
    """The one-call SDK::

        import kiln
        client = kiln.Client("http://127.0.0.1:8000", token)
        artifact = client.submit("model.onnx", precision="auto").wait()
        client.deploy("resnet", artifact.model_sha256, selector={"site": "a"}).wait()

    ``url`` and ``token`` default to ``KILN_API_URL`` / ``KILN_TOKEN``, then the
    ``client.json`` that ``kiln up`` writes under ``KILN_HOME``. ``api`` is the underlying
    ``KilnClient`` (every endpoint, one method each)."""

    def __init__(self, url: str | None = None, token: str | None = None, *,
                 timeout: float = 60.0) -> None:
        if url is None or token is None:
            from kiln.config import ClientSettings

            default_url, default_token = ClientSettings().resolved()
            url, token = url or default_url, token or default_token
        self.api = KilnClient(url, token, timeout=timeout)

    def close(self) -> None:
        self.api.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(self, model: str | Path | bytes, *, precision: Precision | str = Precision.FP32,
               targets: Iterable[str] | None = None, options: CompileOptions | None = None,
               name: str | None = None, **option_fields: Any) -> Job:
        """Upload ``model`` (a path to an ``.onnx``, with its external data beside it, or to
        a model archive; or the ``.onnx`` bytes) and queue a compile per target (default:
        every fingerprint key a live worker builds). ``precision`` and any other
        ``CompileOptions`` field may be given by keyword, or whole as ``options``."""
        options = _compile_options(options, precision, option_fields)
        info = self.api.upload_model(model if isinstance(model, bytes) else Path(model),
                                     name=name)
        keys = list(targets) if targets is not None else \
            self.api.live_fingerprint_keys(info.format)
        if not keys:
            raise InvalidRequest("no live compiler worker is registered that builds "
                                 f"{info.format} models; start one (`kiln worker`) or name "
                                 "the hardware with targets=[FINGERPRINT_KEY]")
        return Job(self.api, info, self.api.create_jobs(info.id, keys, options))

    def job(self, job_id: str) -> CompileJob:
        return self.api.get_job(job_id)

    def deploy(self, name: str, model: str, *, selector: dict[str, str] | None = None,
               precision: Precision | str | None = None, options: CompileOptions | None = None,
               rollout: dict[str, Any] | None = None, **option_fields: Any,
               ) -> DeploymentHandle:
        """Create or update deployment ``name`` serving ``model`` (a model id or unique
        prefix) on the agents whose labels match ``selector``. Without ``options`` or
        ``precision``, the options of the model's latest successful build are used, so a
        model built with ``precision="auto"`` is served as built rather than rebuilt."""
        if options is None and precision is None and not option_fields:
            options = self.api.built_options(model)
        options = _compile_options(options, precision or Precision.FP32, option_fields)
        applied = DeploymentApplied.model_validate(
            self.api.deploy(name, model, selector=selector, options=options, rollout=rollout))
        return DeploymentHandle(self.api, applied)

    def deployment(self, name: str) -> Deployment:
        return Deployment.model_validate(self.api._call("GET", f"/v1/deployments/{name}").json())

    def artifacts(self, **filters: Any) -> list[ArtifactSummary]:
        return self.api.list_artifacts(**filters)

    def manifest(self, artifact_id: str) -> ArtifactManifest:
        return self.api.get_manifest(artifact_id)


def _compile_options(options: CompileOptions | None, precision: Precision | str,
                     fields: dict[str, Any]) -> CompileOptions:
    if options is not None:
        return options.model_copy(update=fields) if fields else options
    return CompileOptions.model_validate({"precision": precision, **fields})

"""Shared by the runtime-agent and SDK tests: signed artifacts compiled from ``kiln.examples``,
a small control plane serving the agent-facing routes over real HTTP, and waiting helpers.

The control plane here implements the routes an agent calls (``POST /v1/agents``,
``POST /v1/agents/{name}/heartbeat``, ``GET /v1/artifacts/{id}``, blob download with Range,
``GET /v1/plugins/{name}/{version}`` and its ``/bundle``) from artifact directories and plugin
bundles on disk; the real API is exercised by the integration tests.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from fastapi import FastAPI, Header, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from artifact_store.signing import (
    DESIRED_STATE_PAYLOAD_TYPE,
    Signer,
    generate_keypair,
    manifest_from_bytes,
)
from compiler_worker.pipeline import compile_model, write_artifact_dir
from kiln.examples import mlp
from runtime_agent.executors import MANIFEST_FILENAME, blob_filename
from runtime_agent.fingerprint import detect_fingerprint
from runtime_agent.server import ServerThread
from schemas._canonical import canonical_json
from schemas.agents import AgentHeartbeat, AgentRegistration, DesiredModel, DesiredState
from schemas.errors import ErrorBody, ErrorCode
from schemas.manifest import ArtifactManifest, BlobRef
from schemas.options import CompileOptions
from schemas.rollouts import RolloutReport
from tests.conftest import free_port, wait_for  # noqa: F401  (wait_for: the agent tests import it from here)

FAST = CompileOptions(verify_samples=2, benchmark_iterations=3, tune="off")
TOKEN = "agent-test-token"


@dataclass
class Keys:
    signer: Signer
    public: Path


def make_keys(directory: Path) -> Keys:
    signer = generate_keypair(directory / "signing.key")
    return Keys(signer, directory / "signing.key.pub")


def compile_signed_mlp(directory: Path, signer: Signer, *, seed: int = 0) -> Path:
    """``mlp(seed=seed)`` compiled for this machine, written signed to ``directory/out``."""
    result = compile_model(mlp(seed=seed).SerializeToString(), FAST,
                           fingerprint=detect_fingerprint(), workdir=directory / "work")
    return write_artifact_dir(result, directory / "out", signer.sign_manifest(result.manifest))


def read_manifest(artifact_dir: Path) -> ArtifactManifest:
    return manifest_from_bytes((artifact_dir / MANIFEST_FILENAME).read_bytes())


def fake_artifact(template: Path, out: Path, artifact_id: str, payload: bytes,
                  signer: Signer | None) -> Path:
    """An artifact directory like ``template``'s whose one ``engine`` blob is ``payload``
    (a loadable engine or not), signed by ``signer`` (or unsigned)."""
    manifest = read_manifest(template)
    ref = BlobRef(name="engine", sha256=hashlib.sha256(payload).hexdigest(), size=len(payload),
                  media_type="application/x-onnx")
    manifest = manifest.model_copy(update={"artifact_id": artifact_id, "blobs": [ref],
                                           "signature": None})
    out.mkdir(parents=True)
    (out / blob_filename(ref)).write_bytes(payload)
    (out / MANIFEST_FILENAME).write_bytes(
        signer.sign_manifest(manifest) if signer is not None
        else manifest.model_dump_json().encode())
    return out


def wrong_golden_artifact(template: Path, out: Path, artifact_id: str, signer: Signer,
                          *, element: int = 5, by: float = 0.5) -> Path:
    """A copy of ``template`` (same engine) whose golden outputs are off by ``by`` at flat
    ``element`` of the last sample, signed under a new id: what an engine that computes
    wrong numbers on this device looks like to the agent's golden check."""
    from runtime_agent.golden import GOLDEN_BLOB, GoldenSample, read_golden, write_golden

    manifest = read_manifest(template)
    shutil.copytree(template, out)
    (ref,) = [b for b in manifest.blobs if b.name == GOLDEN_BLOB]
    path = out / blob_filename(ref)
    samples = read_golden(path)
    name = sorted(samples[-1].outputs)[0]
    wrong = {**samples[-1].outputs, name: samples[-1].outputs[name].copy()}
    wrong[name].flat[element] += by
    write_golden(path, [*samples[:-1], GoldenSample(samples[-1].inputs, wrong)])
    data = path.read_bytes()
    fixed = ref.model_copy(update={"sha256": hashlib.sha256(data).hexdigest(),
                                   "size": len(data)})
    manifest = manifest.model_copy(update={
        "artifact_id": artifact_id, "signature": None,
        "blobs": [fixed if b.name == GOLDEN_BLOB else b for b in manifest.blobs]})
    (out / MANIFEST_FILENAME).write_bytes(signer.sign_manifest(manifest))
    return out


#: ``desired_model``'s default model id: the stub fills in the model of the artifact it names.
FROM_ARTIFACT = "m" * 64


def desired_model(deployment: str, artifact_id: str | None, *,
                  model_id: str = FROM_ARTIFACT) -> DesiredModel:
    return DesiredModel(deployment=deployment, deployment_id=f"dep-{deployment}", generation=1,
                        model_id=model_id, options_digest="0" * 64, backend="onnxruntime",
                        artifact_id=artifact_id, tier="exact" if artifact_id else "none")


def _error(status: int, code: ErrorCode, message: str) -> JSONResponse:
    return JSONResponse(ErrorBody(code=code, message=message).model_dump(mode="json"),
                        status_code=status)


@dataclass
class ControlPlaneStub:
    """The agent-facing routes of the control plane, over artifact directories on disk."""

    artifacts: dict[str, Path] = field(default_factory=dict)
    desired: list[DesiredModel] = field(default_factory=list)
    heartbeat_s: float = 0.05
    registrations: list[AgentRegistration] = field(default_factory=list)
    heartbeats: list[AgentHeartbeat] = field(default_factory=list)
    #: (artifact id, blob name, Range header) of every blob request.
    blob_requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    #: Artifact ids whose blobs are served with one byte flipped.
    tampered: set[str] = field(default_factory=set)
    #: Signs each desired state (the control plane's online key); see ``issue``.
    signer: Signer | None = None
    #: Lifetime of each desired state issued.
    expires_in_s: float = 300.0
    #: Every desired-state envelope served, in order (what an attacker could replay).
    issued: list[bytes] = field(default_factory=list)
    #: When set, served instead of a freshly signed desired state (a replay, a forgery).
    serve_instead: bytes | None = None
    #: Root metadata versions 1, 2, ... (``GET /v1/trust/root/{version}``).
    roots: list[bytes] = field(default_factory=list)
    #: (plugin name, version) → bundle archive.
    plugins: dict[tuple[str, str], Path] = field(default_factory=dict)
    #: (name, version) of every plugin bundle download.
    bundle_requests: list[tuple[str, str]] = field(default_factory=list)
    #: (rollout id, report) of every rollout gate report posted.
    rollout_reports: list[tuple[str, RolloutReport]] = field(default_factory=list)
    url: str = ""

    def add(self, artifact_dir: Path) -> str:
        """Serve the artifact in ``artifact_dir``, and the plugin bundles it carries
        (``plugins/<digest>.tar``) as registered plugins."""
        manifest = read_manifest(artifact_dir)
        for ref in manifest.plugins:
            bundle = artifact_dir / "plugins" / f"{ref.digest}.tar"
            if bundle.is_file():
                self.plugins[(ref.name, ref.version)] = bundle
        self.artifacts[manifest.artifact_id] = artifact_dir
        return manifest.artifact_id

    def issue(self, name: str, *, version: int | None = None, expires_in_s: float | None = None,
              signer: Signer | None = None, agent: str | None = None,
              models: list[DesiredModel] | None = None) -> bytes:
        """A desired state for agent ``name`` as the control plane signs it (each part
        overridable, to forge one)."""
        now = datetime.now(UTC)
        models = [m.model_copy(update={"model_id": read_manifest(
                      self.artifacts[m.artifact_id]).model_sha256})
                  if m.model_id == FROM_ARTIFACT and m.artifact_id in self.artifacts else m
                  for m in (self.desired if models is None else models)]
        state = DesiredState(
            agent=agent or name, models=models,
            heartbeat_s=self.heartbeat_s,
            version=version if version is not None else time.time_ns() // 1000,
            issued_at=now,
            expires=now + timedelta(seconds=self.expires_in_s if expires_in_s is None
                                    else expires_in_s))
        signer = signer or self.signer
        assert signer is not None, "the stub needs a signer to issue desired state"
        return signer.sign_envelope(canonical_json(state), DESIRED_STATE_PAYLOAD_TYPE)

    def reset(self) -> None:
        """Every field back to its default but the server's address: the stub serves a whole
        session, and a setting one test leaves (a 60 s heartbeat, a replayed envelope) must
        not reach the next test on the same worker."""
        fresh = ControlPlaneStub()
        for f in fields(self):
            if f.name != "url":
                setattr(self, f.name, getattr(fresh, f.name))

    def statuses(self, deployment: str) -> list:
        """Every status of ``deployment`` the agent has reported, oldest first."""
        return [status for beat in list(self.heartbeats) for status in beat.models
                if status.deployment == deployment]

    def last_status(self, deployment: str):
        reported = self.statuses(deployment)
        return reported[-1] if reported else None

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.middleware("http")
        async def authenticate(request: Request, call_next):
            if request.headers.get("authorization") != f"Bearer {TOKEN}":
                return _error(401, ErrorCode.UNAUTHENTICATED, "missing or wrong bearer token")
            return await call_next(request)

        def state(name: str) -> Response:
            envelope = self.serve_instead or self.issue(name)
            self.issued.append(envelope)
            return Response(envelope, media_type="application/json")

        @app.post("/v1/agents", response_model=None)
        def register(registration: AgentRegistration) -> Response:
            self.registrations.append(registration)
            return state(registration.name)

        @app.post("/v1/agents/{name}/heartbeat", response_model=None)
        def heartbeat(name: str, beat: AgentHeartbeat) -> Response:
            if name not in {r.name for r in self.registrations}:
                return _error(404, ErrorCode.NOT_FOUND, f"no agent named {name!r}")
            self.heartbeats.append(beat)
            return state(name)

        @app.post("/v1/rollouts/{rollout_id}/reports", response_model=None)
        def rollout_report(rollout_id: str, report: RolloutReport) -> dict:
            self.rollout_reports.append((rollout_id, report))
            return {}

        @app.get("/v1/trust/root/{version}", response_model=None)
        def root(version: int) -> Response:
            if not 1 <= version <= len(self.roots):
                return _error(404, ErrorCode.NOT_FOUND, f"no root metadata version {version}")
            return Response(self.roots[version - 1], media_type="application/json")

        @app.get("/v1/artifacts/{artifact_id}", response_model=None)
        def artifact(artifact_id: str):
            if artifact_id not in self.artifacts:
                return _error(404, ErrorCode.NOT_FOUND, f"no artifact {artifact_id}")
            return {"manifest": read_manifest(self.artifacts[artifact_id]).model_dump(mode="json")}

        @app.get("/v1/artifacts/{artifact_id}/manifest", response_model=None)
        def signed_manifest(artifact_id: str):
            if artifact_id not in self.artifacts:
                return _error(404, ErrorCode.NOT_FOUND, f"no artifact {artifact_id}")
            return Response((self.artifacts[artifact_id] / MANIFEST_FILENAME).read_bytes(),
                            media_type="application/json")

        @app.get("/v1/artifacts/{artifact_id}/blobs/{blob}", response_model=None)
        def blob(artifact_id: str, blob: str, range_: str | None = Header(None, alias="Range")):
            self.blob_requests.append((artifact_id, blob, range_))
            if artifact_id not in self.artifacts:
                return _error(404, ErrorCode.NOT_FOUND, f"no artifact {artifact_id}")
            directory = self.artifacts[artifact_id]
            ref = read_manifest(directory).blob(blob)
            path = directory / blob_filename(ref)
            if artifact_id in self.tampered:
                data = bytearray(path.read_bytes())
                data[len(data) // 2] ^= 0xFF
                return Response(bytes(data))
            return FileResponse(path, headers={"X-Kiln-SHA256": ref.sha256})

        def plugin_record(name: str, version: str) -> dict | None:
            bundle = self.plugins.get((name, version))
            if bundle is None:
                return None
            data = bundle.read_bytes()
            return {"name": name, "version": version, "size_bytes": len(data),
                    "digest": hashlib.sha256(data).hexdigest()}

        @app.get("/v1/plugins/{name}/{version}", response_model=None)
        def plugin(name: str, version: str):
            record = plugin_record(name, version)
            if record is None:
                return _error(404, ErrorCode.NOT_FOUND, f"no plugin {name} {version}")
            return record

        @app.get("/v1/plugins/{name}/{version}/bundle", response_model=None)
        def plugin_bundle(name: str, version: str):
            self.bundle_requests.append((name, version))
            record = plugin_record(name, version)
            if record is None:
                return _error(404, ErrorCode.NOT_FOUND, f"no plugin {name} {version}")
            return FileResponse(self.plugins[(name, version)],
                                headers={"X-Kiln-SHA256": record["digest"]})

        return app


@dataclass
class Fixtures:
    """Session-wide keys and compiled artifacts."""

    keys: Keys
    untrusted: Keys
    #: Two different signed ``mlp`` artifacts.
    mlp_a: Path
    mlp_b: Path


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Fixtures:
    root = tmp_path_factory.mktemp("artifacts")
    keys = make_keys(root / "keys")
    untrusted = make_keys(root / "untrusted")
    return Fixtures(keys, untrusted, compile_signed_mlp(root / "a", keys.signer, seed=0),
                    compile_signed_mlp(root / "b", keys.signer, seed=1))


@pytest.fixture(scope="session")
def _control_plane_server() -> Iterator[ControlPlaneStub]:
    stub = ControlPlaneStub()
    port = free_port()
    server = ServerThread(stub.app(), "127.0.0.1", port)
    server.start()
    stub.url = f"http://127.0.0.1:{port}"
    try:
        yield stub
    finally:
        server.stop()


@pytest.fixture
def control_plane(_control_plane_server: ControlPlaneStub, built: Fixtures) -> ControlPlaneStub:
    """The running control-plane stub, emptied for this test, signing with the trusted key."""
    _control_plane_server.reset()
    _control_plane_server.signer = built.keys.signer
    return _control_plane_server

"""The agent's inference server (FastAPI; run by uvicorn in a thread of the agent).

``POST /v1/models/{name}/infer``
    JSON ``{"inputs": {"x": [[...]]}}`` (dtypes from the manifest's signature) → JSON
    ``{"model", "artifact_id", "outputs": {"y": [[...]]}}``; or an npz body (``np.savez``,
    ``Content-Type: application/x-npz``), and an npz answer with ``Accept: application/x-npz``
    (artifact id in ``X-Kiln-Artifact-Id``). Non-finite JSON outputs are written as
    ``NaN``/``Infinity`` (as Python's ``json`` does); use npz for exact values.
``GET /v1/models``
    The loaded models: artifact, tier, signature and latency statistics.
``/v2/...``
    The Open Inference Protocol (KServe v2) REST API, as ``tritonclient.http`` speaks it
    (``runtime_agent.oip``): ``GET /v2/health/live``, ``/v2/health/ready``, ``GET
    /v2/models/{name}[/versions/{v}]`` (metadata) and ``.../ready``, ``POST
    .../infer`` with JSON tensors or the binary-data extension (a JSON header of
    ``Inference-Header-Content-Length`` bytes, then the raw tensors), and Triton's ``POST
    /v2/repository/index``. Errors are ``{"error": message}``; the one version of a model is
    its artifact id.
``GET /metrics``
    Prometheus: Kiln's own and Triton's ``nv_inference_*`` (``runtime_agent.inference``).
``GET /healthz``
    Liveness: the process answers (no check of anything else; cheap).
``GET /readyz``
    Readiness: 200 when every check passes, else 503 naming what is not ready; each check's
    state either way (``ReadyCheck``): ``engines`` (at least one loaded), and from the agent
    ``deployments`` (none failed with nothing serving it) and ``control_plane`` (unreachable
    for longer than ``KILN_AGENT_READY_OFFLINE_S`` while nothing is cached is not ready).

Every error is an ``ErrorBody`` JSON with the status of its code: a bad input is a 4xx that
says what was expected, and the server keeps serving.
"""

from __future__ import annotations

import hmac
import importlib.metadata
import io
import json
import logging
import threading
import time
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from artifact_store.http_guard import ConnectionLimits
from runtime_agent import inference, oip
from runtime_agent.bounded import check_npz, load_json
from runtime_agent.config import get_settings
from runtime_agent.inference import Metrics
from runtime_agent.oip import array_from_json
from runtime_agent.serving import ModelTable, ServedModel
from schemas.errors import (
    ConfigError,
    ErrorBody,
    ErrorCode,
    InvalidRequest,
    KilnError,
    PayloadTooLarge,
)
from schemas.manifest import TensorSpec

logger = logging.getLogger(__name__)

NPZ = "application/x-npz"
JSON = "application/json"
ARTIFACT_HEADER = "X-Kiln-Artifact-Id"
#: Largest JSON an inference request may carry (``KILN_AGENT_MAX_JSON_BYTES``' default).
DEFAULT_MAX_JSON_BYTES = 16 * 1024 * 1024
_HTTP_CODES = {404: ErrorCode.NOT_FOUND, 405: ErrorCode.INVALID_REQUEST,
               413: ErrorCode.PAYLOAD_TOO_LARGE}
#: Health probes: they need no token.
_PROBES = frozenset({"/healthz", "/readyz", "/v2/health/live", "/v2/health/ready"})


@dataclass(frozen=True)
class ReadyCheck:
    """One readiness check: whether it passes, a one-word state, and what it found."""

    ok: bool
    state: str
    detail: str


#: Extra readiness checks by name (the agent's: deployments, control plane).
Readiness = Callable[[], dict[str, ReadyCheck]]


def engines_check(table: ModelTable) -> ReadyCheck:
    names = table.names()
    if not names:
        return ReadyCheck(False, "none", "no engine loaded")
    return ReadyCheck(True, "loaded", f"{len(names)} loaded: {', '.join(names)}")


# ---------------------------------------------------------------- decoding and encoding
def decode_json(body: bytes, specs: list[TensorSpec], *,
                max_bytes: int = DEFAULT_MAX_JSON_BYTES) -> dict[str, np.ndarray]:
    """The feed of a JSON request ``{"inputs": {name: nested list}}`` (size and depth
    bounded before parsing)."""
    document = load_json(body, max_bytes=max_bytes, what="the request body")
    expected = {spec.name: spec for spec in specs}
    if not isinstance(document, dict) or not isinstance(document.get("inputs"), dict):
        raise InvalidRequest(
            f'expected a JSON object {{"inputs": {{"<name>": <nested list>, ...}}}} with the '
            f"inputs {[f'{s.name}: {s.dtype}{list(s.shape)}' for s in specs]}"
        )
    # An unknown name gets a placeholder: validate_inputs reports names before any value.
    return {
        name: array_from_json(expected[name], value) if name in expected else np.empty(0)
        for name, value in document["inputs"].items()
    }


def decode_npz(body: bytes, max_bytes: int,
               specs: list[TensorSpec] | None = None) -> dict[str, np.ndarray]:
    """The feed of an npz request; decompressed arrays may not exceed ``max_bytes`` either.
    With ``specs`` (the model's inputs), every array's header is checked against them and the
    byte cap before any array is read."""
    if specs is not None:
        check_npz(body, specs, max_bytes)
    try:
        archive = np.load(io.BytesIO(body), allow_pickle=False)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise InvalidRequest(
            f"the request body is not an npz archive (write it with np.savez): {exc}"
        ) from exc
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise InvalidRequest("expected an npz archive of named arrays (np.savez(f, x=...)); got "
                             "a single .npy array")
    with archive:
        unpacked = sum(info.file_size for info in archive.zip.infolist())
        if unpacked > max_bytes:
            raise PayloadTooLarge(
                f"the npz archive unpacks to {unpacked} bytes, over the limit of {max_bytes}",
                limit_bytes=max_bytes,
            )
        feed: dict[str, np.ndarray] = {}
        for name in archive.files:
            try:
                feed[name] = archive[name]
            except (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
                raise InvalidRequest(f"array {name!r} of the npz cannot be read: {exc}") from exc
    return feed


def encode_npz(outputs: dict[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **outputs)
    return buffer.getvalue()


def _jsonable(array: np.ndarray) -> Any:
    if array.dtype.kind == "c":
        array = np.stack([array.real, array.imag], axis=-1)
    elif array.dtype.kind not in "biufUO":  # ml_dtypes floats (bfloat16, float8 ...)
        array = array.astype(np.float32)
    return array.tolist()


def _json_response(content: Any, status: int = 200, headers: dict[str, str] | None = None):
    body = json.dumps(content, separators=(",", ":")).encode()
    return Response(body, status_code=status, media_type=JSON, headers=headers)


def _error_response(status: int, body: ErrorBody,
                    headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=body.model_dump(mode="json"),
                        headers=headers)


async def _read_body(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise PayloadTooLarge(
            f"the request body of {declared} bytes is over the limit of {max_bytes} bytes "
            f"(KILN_AGENT_MAX_BODY_BYTES)", limit_bytes=max_bytes,
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise PayloadTooLarge(
                f"the request body is over the limit of {max_bytes} bytes "
                f"(KILN_AGENT_MAX_BODY_BYTES)", limit_bytes=max_bytes,
            )
        chunks.append(chunk)
    return b"".join(chunks)


# ---------------------------------------------------------------- the app
def create_app(
    table: ModelTable,
    *,
    max_body_bytes: int = 64 * 1024 * 1024,
    max_json_bytes: int = DEFAULT_MAX_JSON_BYTES,
    registry: CollectorRegistry | None = None,
    token: str | None = None,
    readiness: Readiness | None = None,
    trust: Callable[[], BaseModel] | None = None,
) -> FastAPI:
    """The inference app over the models in ``table``. With ``token``, every route but the
    health probes (``/healthz``, ``/readyz``, ``/v2/health/*``) needs ``Authorization: Bearer
    <token>`` (401 otherwise). ``readiness`` adds checks to ``/readyz``. ``trust`` says where
    the agent stands with its signed desired state (``/healthz`` shows it: ``stale`` once it
    expired)."""
    app = FastAPI(title="Kiln agent", summary="Inference on the engines this agent serves")
    metrics = Metrics(table, registry)
    app.state.metrics = metrics

    def error(request: Request, status: int, body: ErrorBody,
              headers: dict[str, str] | None = None) -> JSONResponse:
        """An error in the form of the route's protocol: ``{"error": message}`` under
        ``/v2``, an ``ErrorBody`` elsewhere."""
        if request.url.path.startswith("/v2"):
            return JSONResponse(status_code=status, content={"error": body.message},
                                headers=headers)
        return _error_response(status, body, headers)

    if token:
        expected = f"Bearer {token}".encode()

        @app.middleware("http")
        async def _require_token(request: Request, call_next):
            if request.url.path not in _PROBES:
                given = request.headers.get("authorization", "").encode()
                if not hmac.compare_digest(given, expected):
                    body = ErrorBody(
                        code=ErrorCode.UNAUTHENTICATED,
                        message="this agent's inference server needs 'Authorization: Bearer "
                                "<token>' (the agent's KILN_AGENT_SERVE_TOKEN)")
                    return error(request, 401, body, {"WWW-Authenticate": "Bearer"})
            return await call_next(request)

    @app.exception_handler(KilnError)
    async def _kiln_error(request: Request, exc: KilnError):
        if exc.http_status >= 500:
            logger.error("%s %s failed: %s", request.method, request.url.path, exc.message)
        return error(request, exc.http_status, exc.to_body())

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        problems = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}"
                             for e in exc.errors())
        body = ErrorBody(code=ErrorCode.INVALID_REQUEST, message=f"invalid request: {problems}")
        return error(request, 400, body)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = _HTTP_CODES.get(exc.status_code, ErrorCode.INVALID_REQUEST)
        message = str(exc.detail)
        if exc.status_code == 404:
            message = (f"no route {request.method} {request.url.path}; routes are POST "
                       f"/v1/models/{{name}}/infer, GET /v1/models, the Open Inference "
                       f"Protocol's /v2/health/{{live,ready}}, /v2/models/{{name}}[/versions/"
                       f"{{v}}][/ready|/infer|/config|/stats], POST /v2/repository/index, "
                       f"/metrics, /healthz")
        return error(request, exc.status_code, ErrorBody(code=code, message=message))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        body = ErrorBody(code=ErrorCode.INTERNAL, message="internal error; see the agent log")
        return error(request, 500, body)

    # ------------------------------------------------------------ Kiln's own protocol
    @app.post("/v1/models/{name}/infer")
    async def infer(name: str, request: Request) -> Response:
        """Run model ``name`` on the request's inputs (JSON or npz)."""
        started = time.perf_counter()
        model = table.get(name)
        body = await _read_body(request, max_body_bytes)
        content_type = request.headers.get("content-type", JSON).split(";")[0].strip().lower()

        def decode() -> dict[str, np.ndarray]:
            if content_type == NPZ:
                return decode_npz(body, max_body_bytes, model.manifest.inputs)
            if content_type in (JSON, ""):
                return decode_json(body, model.manifest.inputs, max_bytes=max_json_bytes)
            raise InvalidRequest(
                f"unsupported Content-Type {content_type!r}; send {JSON} "
                f'({{"inputs": {{...}}}}) or {NPZ} (np.savez)'
            )

        outputs = await run_in_threadpool(inference.run, model, decode, metrics,
                                          started=started)
        headers = {ARTIFACT_HEADER: model.artifact_id}
        if NPZ in request.headers.get("accept", ""):
            return Response(encode_npz(outputs), media_type=NPZ, headers=headers)
        return _json_response(
            {"model": name, "artifact_id": model.artifact_id,
             "outputs": {key: _jsonable(value) for key, value in outputs.items()}},
            headers=headers,
        )

    @app.get("/v1/models")
    def list_models() -> list[dict[str, Any]]:
        """The loaded models, with their artifact, tier, signature and latency statistics."""
        return [model.describe() for model in table.all()]

    # ------------------------------------------------------------ Open Inference Protocol
    @app.get("/v2")
    def server_metadata() -> dict[str, Any]:
        return {"name": oip.SERVER_NAME, "version": server_version(),
                "extensions": oip.EXTENSIONS}

    @app.get("/v2/health/live")
    def live() -> Response:
        return Response(status_code=200)

    @app.get("/v2/health/ready")
    def ready() -> Response:
        """Ready when at least one model is loaded: an agent with none can infer nothing."""
        return Response(status_code=200 if table.names() else 400)

    @app.post("/v2/repository/index")
    def repository_index() -> list[dict[str, Any]]:
        """Triton's model-repository extension: every loaded model, ready."""
        return [{"name": m.name, "version": m.artifact_id, "state": "READY", "reason": ""}
                for m in table.all()]

    @app.get("/v2/models/stats")
    # Before the model-metadata route, whose path would take "stats" for a model's name.
    def all_stats() -> dict[str, Any]:
        return oip.statistics(table)

    @app.get("/v2/models/{name}")
    @app.get("/v2/models/{name}/versions/{version}")
    def model_metadata(name: str, version: str = "") -> dict[str, Any]:
        return oip.metadata(oip.resolve(table, name, version))

    @app.get("/v2/models/{name}/ready")
    @app.get("/v2/models/{name}/versions/{version}/ready")
    def model_ready(name: str, version: str = "") -> Response:
        oip.resolve(table, name, version)
        return Response(status_code=200)

    @app.get("/v2/models/{name}/config")
    @app.get("/v2/models/{name}/versions/{version}/config")
    def model_config(name: str, version: str = "") -> dict[str, Any]:
        return oip.model_config(oip.resolve(table, name, version))

    @app.get("/v2/models/{name}/stats")
    @app.get("/v2/models/{name}/versions/{version}/stats")
    def model_stats(name: str, version: str = "") -> dict[str, Any]:
        return oip.statistics(table, name, version)

    @app.post("/v2/models/{name}/infer")
    @app.post("/v2/models/{name}/versions/{version}/infer")
    async def v2_infer(name: str, request: Request, version: str = "") -> Response:
        """An inference in JSON, or with the binary-data extension (tritonclient's)."""
        started = time.perf_counter()
        model = oip.resolve(table, name, version)
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise InvalidRequest(f"unsupported Content-Encoding {encoding!r}; send the "
                                 f"request uncompressed")
        declared = request.headers.get(oip.HEADER_LENGTH)
        if declared is not None and not declared.strip().isdigit():
            raise InvalidRequest(f"{oip.HEADER_LENGTH} must be a byte count; given "
                                 f"{declared!r}")
        body = await _read_body(request, max_body_bytes)
        header_length = int(declared) if declared is not None else None
        content, json_length = await run_in_threadpool(
            _v2_infer, model, body, header_length, metrics, started, max_json_bytes)
        if json_length is None:
            return Response(content, media_type=JSON)
        return Response(content, media_type="application/octet-stream",
                        headers={oip.HEADER_LENGTH: str(json_length)})

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        """Liveness: the process serves requests (and whether its desired state is stale)."""
        health: dict[str, Any] = {"status": "ok", "models": table.names()}
        if trust is not None:
            status = trust().model_dump(mode="json")
            health["trust"] = status
            if status.get("stale"):
                health["status"] = "stale"
        return health

    @app.get("/readyz")
    def readyz() -> JSONResponse:
        """Readiness: 200 when every check passes, else 503 naming those that do not."""
        checks = {"engines": engines_check(table), **(readiness() if readiness else {})}
        failing = [f"{name}: {check.detail}" for name, check in checks.items() if not check.ok]
        return JSONResponse(
            status_code=503 if failing else 200,
            content={"ready": not failing, "not_ready": failing,
                     "checks": {name: asdict(check) for name, check in checks.items()}})

    return app


def _v2_infer(model: ServedModel, body: bytes, header_length: int | None, metrics: Metrics,
              started: float, max_json_bytes: int) -> tuple[bytes, int | None]:
    """Decode, run and encode one REST inference (in a worker thread, off the event loop)."""
    decoded: list[oip.RestRequest] = []

    def decode() -> dict[str, np.ndarray]:
        decoded.append(oip.decode_rest(model, body, header_length,
                                       max_json_bytes=max_json_bytes))
        return decoded[0].feed

    outputs = inference.run(model, decode, metrics, started=started)
    return oip.encode_rest(model, decoded[0], outputs)


def server_version() -> str:
    """Kiln's installed version, reported as the server's."""
    try:
        return importlib.metadata.version("kiln")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class ServerThread:
    """Runs an ASGI app with uvicorn in a daemon thread (the agent's inference server), with
    ``limits`` on what a client holds before its request is whole
    (``artifact_store.http_guard``; default: the agent's settings, ``KILN_AGENT_SERVE_*``)."""

    def __init__(self, app: FastAPI, host: str, port: int, *,
                 limits: ConnectionLimits | None = None) -> None:
        if limits is None:
            limits = get_settings().connection_limits()
        config = uvicorn.Config(app, host=host, port=port, lifespan="off", access_log=False,
                                log_level="warning", **limits.uvicorn_options())
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="kiln-agent-server",
                                        daemon=True)
        self.host, self.port = host, port

    def start(self, timeout_s: float = 10.0) -> None:
        """Start serving; ``ConfigError`` when the server cannot listen."""
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise ConfigError(
                    f"the server could not listen on {self.host}:{self.port} (see the log); "
                    f"choose another port (agent: --port, or 0 for no server)"
                )
            time.sleep(0.02)
        logger.info("listening on http://%s:%d", self.host, self.port)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout_s)

"""The agent's inference server (FastAPI; run by uvicorn in a thread of the agent).

``POST /v1/models/{name}/infer``
    JSON ``{"inputs": {"x": [[...]]}}`` (dtypes from the manifest's signature) → JSON
    ``{"model", "artifact_id", "outputs": {"y": [[...]]}}``; or an npz body (``np.savez``,
    ``Content-Type: application/x-npz``), and an npz answer with ``Accept: application/x-npz``
    (artifact id in ``X-Kiln-Artifact-Id``). Non-finite JSON outputs are written as
    ``NaN``/``Infinity`` (as Python's ``json`` does); use npz for exact values.
``GET /v1/models``
    The loaded models: artifact, tier, signature and latency statistics.
``GET /metrics``
    Prometheus: requests by model, artifact and outcome, and a latency histogram.
``GET /healthz``

Every error is an ``ErrorBody`` JSON with the status of its code: a bad input is a 4xx that
says what was expected, and the server keeps serving.
"""

from __future__ import annotations

import hmac
import io
import json
import logging
import threading
import time
import zipfile
import zlib
from typing import Any

import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime_agent.samples import numpy_dtype
from runtime_agent.serving import ModelTable
from schemas.errors import (
    ConfigError,
    ErrorBody,
    ErrorCode,
    InvalidRequest,
    KilnError,
    ModelTooLarge,
)
from schemas.manifest import TensorSpec

logger = logging.getLogger(__name__)

NPZ = "application/x-npz"
JSON = "application/json"
ARTIFACT_HEADER = "X-Kiln-Artifact-Id"
#: Latency histogram buckets, seconds: engines answer in well under a millisecond to seconds.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0)
_HTTP_CODES = {404: ErrorCode.NOT_FOUND, 405: ErrorCode.INVALID_REQUEST,
               413: ErrorCode.MODEL_TOO_LARGE}


# ---------------------------------------------------------------- decoding and encoding
def _array_from_json(spec: TensorSpec, value: Any) -> np.ndarray:
    """``value`` (nested lists) as an array of ``spec``'s dtype, refusing lossy conversions."""
    where = f"input {spec.name!r} ({spec.dtype}{list(spec.shape)})"
    try:
        array = np.asarray(value)
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(f"{where}: expected a nested list of numbers; {exc}") from exc
    dtype = numpy_dtype(spec.dtype)
    if array.size == 0:
        return array.astype(dtype)
    kind, target = array.dtype.kind, dtype.kind
    if kind not in "biuf" or (target == "b") != (kind == "b"):
        given = {"b": "booleans", "O": "mixed or non-numeric values", "U": "strings"}.get(
            kind, f"values of type {array.dtype}")
        wanted = "booleans (true/false)" if target == "b" else "numbers"
        raise InvalidRequest(f"{where}: expected {wanted}; given {given}")
    if target in "iu":
        if kind == "f":
            raise InvalidRequest(f"{where}: expected integers; given non-integer numbers")
        info = np.iinfo(dtype)
        if array.min() < info.min or array.max() > info.max:
            raise InvalidRequest(
                f"{where}: values must lie in [{info.min}, {info.max}]; given "
                f"[{array.min()}, {array.max()}]"
            )
    return array.astype(dtype)


def decode_json(body: bytes, specs: list[TensorSpec]) -> dict[str, np.ndarray]:
    """The feed of a JSON request ``{"inputs": {name: nested list}}``."""
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from exc
    expected = {spec.name: spec for spec in specs}
    if not isinstance(document, dict) or not isinstance(document.get("inputs"), dict):
        raise InvalidRequest(
            f'expected a JSON object {{"inputs": {{"<name>": <nested list>, ...}}}} with the '
            f"inputs {[f'{s.name}: {s.dtype}{list(s.shape)}' for s in specs]}"
        )
    # An unknown name gets a placeholder: validate_inputs reports names before any value.
    return {
        name: _array_from_json(expected[name], value) if name in expected else np.empty(0)
        for name, value in document["inputs"].items()
    }


def decode_npz(body: bytes, max_bytes: int) -> dict[str, np.ndarray]:
    """The feed of an npz request; decompressed arrays may not exceed ``max_bytes`` either."""
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
            raise ModelTooLarge(
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
        raise ModelTooLarge(
            f"the request body of {declared} bytes is over the limit of {max_bytes} bytes "
            f"(KILN_AGENT_MAX_BODY_BYTES)", limit_bytes=max_bytes,
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise ModelTooLarge(
                f"the request body is over the limit of {max_bytes} bytes "
                f"(KILN_AGENT_MAX_BODY_BYTES)", limit_bytes=max_bytes,
            )
        chunks.append(chunk)
    return b"".join(chunks)


# ---------------------------------------------------------------- metrics
class _LoadedModels:
    """A collector: ``kiln_agent_model_info{model, artifact, backend, tier} 1`` per model."""

    def __init__(self, table: ModelTable) -> None:
        self.table = table

    def collect(self):
        family = GaugeMetricFamily("kiln_agent_model_info", "Models loaded on this agent",
                                   labels=["model", "artifact", "backend", "tier"])
        for model in self.table.all():
            family.add_metric([model.name, model.artifact_id, model.manifest.backend,
                               model.tier], 1.0)
        yield family


class Metrics:
    """The agent's Prometheus metrics, in their own registry."""

    def __init__(self, table: ModelTable, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.requests = Counter(
            "kiln_agent_requests", "Inference requests by model, artifact and outcome",
            ["model", "artifact", "outcome"], registry=self.registry,
        )
        self.latency = Histogram(
            "kiln_agent_request_seconds", "Latency of successful inference requests",
            ["model", "artifact"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.registry.register(_LoadedModels(table))


# ---------------------------------------------------------------- the app
def create_app(
    table: ModelTable,
    *,
    max_body_bytes: int = 64 * 1024 * 1024,
    registry: CollectorRegistry | None = None,
    token: str | None = None,
) -> FastAPI:
    """The inference app over the models in ``table``. With ``token``, every route but
    ``/healthz`` needs ``Authorization: Bearer <token>`` (401 otherwise)."""
    app = FastAPI(title="Kiln agent", summary="Inference on the engines this agent serves")
    metrics = Metrics(table, registry)
    app.state.metrics = metrics

    if token:
        expected = f"Bearer {token}".encode()

        @app.middleware("http")
        async def _require_token(request: Request, call_next):
            if request.url.path != "/healthz":
                given = request.headers.get("authorization", "").encode()
                if not hmac.compare_digest(given, expected):
                    body = ErrorBody(
                        code=ErrorCode.UNAUTHENTICATED,
                        message="this agent's inference server needs 'Authorization: Bearer "
                                "<token>' (the agent's KILN_AGENT_SERVE_TOKEN)")
                    return _error_response(401, body, {"WWW-Authenticate": "Bearer"})
            return await call_next(request)

    @app.exception_handler(KilnError)
    async def _kiln_error(request: Request, exc: KilnError):
        if exc.http_status >= 500:
            logger.error("%s %s failed: %s", request.method, request.url.path, exc.message)
        return _error_response(exc.http_status, exc.to_body())

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        problems = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}"
                             for e in exc.errors())
        body = ErrorBody(code=ErrorCode.INVALID_REQUEST, message=f"invalid request: {problems}")
        return _error_response(400, body)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = _HTTP_CODES.get(exc.status_code, ErrorCode.INVALID_REQUEST)
        message = str(exc.detail)
        if exc.status_code == 404:
            message = (f"no route {request.method} {request.url.path}; routes are POST "
                       f"/v1/models/{{name}}/infer, GET /v1/models, /metrics, /healthz")
        return _error_response(exc.status_code, ErrorBody(code=code, message=message))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        body = ErrorBody(code=ErrorCode.INTERNAL, message="internal error; see the agent log")
        return _error_response(500, body)

    @app.post("/v1/models/{name}/infer")
    async def infer(name: str, request: Request) -> Response:
        """Run model ``name`` on the request's inputs (JSON or npz)."""
        model = table.get(name)
        body = await _read_body(request, max_body_bytes)
        content_type = request.headers.get("content-type", JSON).split(";")[0].strip().lower()
        artifact = model.artifact_id
        try:
            if content_type == NPZ:
                feed = decode_npz(body, max_body_bytes)
            elif content_type in (JSON, ""):
                feed = decode_json(body, model.manifest.inputs)
            else:
                raise InvalidRequest(
                    f"unsupported Content-Type {content_type!r}; send {JSON} "
                    f'({{"inputs": {{...}}}}) or {NPZ} (np.savez)'
                )
            started = time.perf_counter()
            outputs = await run_in_threadpool(model.executor.run, feed)
            elapsed = time.perf_counter() - started
        except KilnError as exc:
            model.stats.record_error()
            metrics.requests.labels(name, artifact, exc.code.value).inc()
            raise
        model.stats.record(elapsed)
        metrics.requests.labels(name, artifact, "ok").inc()
        metrics.latency.labels(name, artifact).observe(elapsed)
        headers = {ARTIFACT_HEADER: artifact}
        if NPZ in request.headers.get("accept", ""):
            return Response(encode_npz(outputs), media_type=NPZ, headers=headers)
        return _json_response(
            {"model": name, "artifact_id": artifact,
             "outputs": {key: _jsonable(value) for key, value in outputs.items()}},
            headers=headers,
        )

    @app.get("/v1/models")
    def list_models() -> list[dict[str, Any]]:
        """The loaded models, with their artifact, tier, signature and latency statistics."""
        return [model.describe() for model in table.all()]

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        return {"status": "ok", "models": table.names()}

    return app


class ServerThread:
    """Runs an ASGI app with uvicorn in a daemon thread (the agent's inference server)."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        config = uvicorn.Config(app, host=host, port=port, lifespan="off", access_log=False,
                                log_level="warning")
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

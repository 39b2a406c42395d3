"""Starting a compiler worker: work out this machine's fingerprint keys, consume only their
queues, heartbeat through the API (``PUT /v1/builds/workers/{name}``) so the control plane
knows which hardware is served, and answer ``/healthz`` and ``/readyz`` (the broker and the
API) on ``KILN_WORKER_HEALTH_PORT`` when it is set.

A worker's identity is its name plus an instance id drawn at every start
(``WorkerSettings.instance``): the heartbeat carries both, and so does every job it claims.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from celery.signals import worker_ready, worker_shutdown

from compiler_worker.backends import available
from compiler_worker.backends.base import PIPELINE_MODEL_FORMATS
from compiler_worker.config import WorkerSettings, get_worker_settings
from compiler_worker.jobs import JobRunner
from compiler_worker.queue import broker_probe, celery_app, configure_celery
from schemas.builds import WorkerHeartbeat
from schemas.errors import KilnError
from schemas.fingerprint import HardwareFingerprint
from schemas.health import readiness
from schemas.options import CompileOptions, Precision
from schemas.queue import queue_for

logger = logging.getLogger(__name__)


def fingerprint_keys(fingerprint: HardwareFingerprint) -> list[str]:
    """Every key this machine can build: one per registered backend that supports it and
    takes a model format the pipeline hands out (``PIPELINE_MODEL_FORMATS``), each followed
    by its own tuning context's key (``Backend.context_key``), under which the control
    plane queues the tuning of a node like this one."""
    keys: list[str] = []
    for backend in available():
        if backend.supports(fingerprint) and backend.model_formats & PIPELINE_MODEL_FORMATS:
            keys += [k for k in (backend.fingerprint_key(fingerprint),
                                 backend.context_key(fingerprint)) if k not in keys]
    return keys


def model_formats(fingerprint: HardwareFingerprint) -> dict[str, list[str]]:
    """Fingerprint key → the model formats the pipeline hands its backend
    (``WorkerInfo.model_formats``: the control plane refuses a job whose model the key's
    backend cannot take)."""
    return {b.fingerprint_key(fingerprint): sorted(b.model_formats & PIPELINE_MODEL_FORMATS)
            for b in available()
            if b.supports(fingerprint) and b.model_formats & PIPELINE_MODEL_FORMATS}


def precisions(fingerprint: HardwareFingerprint) -> dict[str, list[str]]:
    """Fingerprint key → the precision policies its backend builds (``WorkerInfo.precisions``:
    the control plane refuses a job asking a key for another, rather than queue one that
    fails here)."""
    found: dict[str, list[str]] = {}
    for backend in available():
        if not (backend.supports(fingerprint) and backend.model_formats & PIPELINE_MODEL_FORMATS):
            continue
        accepted = []
        for precision in Precision:
            try:
                backend.check_options(CompileOptions(precision=precision))
            except KilnError:
                continue
            accepted.append(precision.value)
        found[backend.fingerprint_key(fingerprint)] = accepted
    return found


def portable_keys(fingerprint: HardwareFingerprint) -> dict[str, str]:
    """Fingerprint key → the compatibility key of the portable engines built there, for every
    registered backend that supports this machine and builds any (``WorkerInfo.portable_keys``).
    """
    keys = {}
    for backend in available():
        if backend.supports(fingerprint):
            portable = backend.portable_key(fingerprint)
            if portable is not None:
                keys[backend.fingerprint_key(fingerprint)] = portable
    return keys


#: Seconds before a failed heartbeat is tried again (at most the heartbeat interval): one
#: lost beat must not count as a missed one.
HEARTBEAT_RETRY_S = 1.0


class Heartbeat:
    def __init__(self, runner: JobRunner, keys: list[str]) -> None:
        self.runner = runner
        self.keys = keys
        self.portable = portable_keys(runner.fingerprint)
        self.formats = model_formats(runner.fingerprint)
        self.precisions = precisions(runner.fingerprint)
        # A cross target's keys are advertised as the worker's own (the planner routes that
        # node's builds here), with what their backends take and build for them.
        for target in {id(t): t for t in runner.cross_targets.values()}.values():
            self.formats.update({k: v for k, v in model_formats(target).items()
                                 if k in runner.cross_targets})
            self.precisions.update({k: v for k, v in precisions(target).items()
                                    if k in runner.cross_targets})
        self.interval_s = runner.settings.worker_heartbeat_s
        self._stop = threading.Event()
        self._first_wait = self.interval_s
        self._thread = threading.Thread(target=self._loop, name="kiln-heartbeat", daemon=True)

    def beat(self, *, stopping: bool = False) -> None:
        settings = self.runner.settings
        self.runner.builds.heartbeat(settings.worker_name, WorkerHeartbeat(
            instance=settings.instance, fingerprint_keys=self.keys,
            fingerprint=self.runner.fingerprint, portable_keys=self.portable,
            model_formats=self.formats, precisions=self.precisions,
            heartbeat_s=self.interval_s, stopping=stopping))

    def start(self) -> None:
        """Beat now and then every ``interval_s``. A first beat that fails (the API not up
        yet) is retried by the loop within ``HEARTBEAT_RETRY_S``, as any failed beat is."""
        try:
            self.beat()
            self._first_wait = self.interval_s
        except Exception as exc:
            self._first_wait = min(HEARTBEAT_RETRY_S, self.interval_s)
            logger.warning("heartbeat failed (%s: %s); retrying in %gs", type(exc).__name__,
                           exc, self._first_wait)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        try:
            self.beat(stopping=True)
        except Exception as exc:  # shutting down: the row simply ages out
            logger.warning("could not record the worker's shutdown: %s", exc)

    def _loop(self) -> None:
        """Beat every ``interval_s``; a failed beat is tried again after
        ``HEARTBEAT_RETRY_S`` (or the interval, if shorter), not a whole interval later."""
        wait = self._first_wait
        while not self._stop.wait(wait):
            try:
                self.beat()
                wait = self.interval_s
            except Exception as exc:
                wait = min(HEARTBEAT_RETRY_S, self.interval_s)
                logger.warning("heartbeat failed (%s: %s); retrying in %gs",
                               type(exc).__name__, exc, wait)


class HealthServer:
    """``GET /healthz`` (the worker process answers) and ``GET /readyz`` (its broker and the
    API answer, each with its latency; 503 naming what is down), served by a thread of the
    worker's main process. A plain HTTP server: the worker runs no web framework, and these
    two routes need none. The worker reaches no database and no store: the API does."""

    def __init__(self, runner: JobRunner, host: str, port: int) -> None:
        settings = runner.settings
        identity = {"worker": settings.worker_name, "instance": settings.instance}
        probes = {"broker": broker_probe(settings),
                  "api": lambda: runner.builds.ping()}

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/healthz":
                    status, body = 200, {"status": "ok", **identity}
                elif self.path == "/readyz":
                    status, body = readiness(probes)
                    body = {**body, **identity}
                else:
                    status, body = 404, {"code": "not_found",
                                         "message": "the worker serves /healthz and /readyz"}
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:
                logger.debug("health: " + format, *args)

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever,
                                        name="kiln-worker-health", daemon=True)

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def start(self) -> None:
        self._thread.start()
        logger.info("worker health on http://%s:%d/readyz", *self.server.server_address[:2])

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def run_worker(*, concurrency: int | None = None, pool: str = "prefork",
               settings: WorkerSettings | None = None) -> None:
    settings = settings or get_worker_settings()
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.worker_name == os.uname().nodename:
        settings.worker_name = f"{settings.worker_name}-{os.getpid()}"
    configure_celery(settings)
    import compiler_worker.tasks  # noqa: F401  (registers the task on the worker's app)

    runner = JobRunner(settings)
    runner.builds  # noqa: B018  (refuse to start without the control plane's URL and a token)
    keys = fingerprint_keys(runner.fingerprint)
    keys += [k for k in runner.cross_targets if k not in keys]
    if not keys:
        raise SystemExit(f"no registered backend supports this machine: {runner.fingerprint}")
    queues = [queue_for(k) for k in keys]
    heartbeat = Heartbeat(runner, keys)
    worker_ready.connect(lambda **_: heartbeat.start(), weak=False)
    worker_shutdown.connect(lambda **_: heartbeat.stop(), weak=False)
    if settings.worker_health_port is not None:
        # Bound before Celery starts, so a taken port stops the worker at once.
        health = HealthServer(runner, settings.worker_health_host, settings.worker_health_port)
        worker_ready.connect(lambda **_: health.start(), weak=False)
        worker_shutdown.connect(lambda **_: health.stop(), weak=False)
    logger.info("worker %s (instance %s) consumes %s", settings.worker_name,
                settings.instance, queues)
    celery_app.worker_main([
        "worker",
        "--queues", ",".join(queues),
        "--concurrency", str(concurrency or settings.worker_concurrency),
        "--pool", pool,
        "--hostname", f"{settings.worker_name}@%h",
        "--loglevel", settings.log_level,
        "--without-gossip", "--without-mingle",
    ])

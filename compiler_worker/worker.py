"""Starting a compiler worker: work out this machine's fingerprint keys, consume only their
queues, and keep a heartbeat row in SQL so the control plane knows which hardware is served."""

from __future__ import annotations

import logging
import os
import threading

from celery.signals import worker_ready, worker_shutdown

from compiler_worker.backends import available
from compiler_worker.backends.base import PIPELINE_MODEL_FORMATS
from compiler_worker.config import WorkerSettings, get_worker_settings
from compiler_worker.jobs import JobRunner
from schemas import HardwareFingerprint
from services.db import repo, session_scope
from services.queue import celery_app, configure_celery, queue_for

logger = logging.getLogger(__name__)


def fingerprint_keys(fingerprint: HardwareFingerprint) -> list[str]:
    """Every key this machine can build: one per registered backend that supports it and
    takes a model format the pipeline hands out (``PIPELINE_MODEL_FORMATS``)."""
    return [b.fingerprint_key(fingerprint) for b in available()
            if b.supports(fingerprint) and b.model_formats & PIPELINE_MODEL_FORMATS]


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


class Heartbeat:
    def __init__(self, runner: JobRunner, keys: list[str]) -> None:
        self.runner = runner
        self.keys = keys
        self.portable = portable_keys(runner.fingerprint)
        self.interval_s = runner.settings.worker_heartbeat_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kiln-heartbeat", daemon=True)

    def beat(self, *, stopping: bool = False) -> None:
        with session_scope(self.runner.sessions) as session:
            repo.heartbeat_worker(
                session, name=self.runner.settings.worker_name, fingerprint_keys=self.keys,
                fingerprint=self.runner.fingerprint, portable_keys=self.portable,
                heartbeat_s=self.interval_s, stopping=stopping,
            )

    def start(self) -> None:
        self.beat()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        try:
            self.beat(stopping=True)
        except Exception:  # shutting down: the row simply ages out
            logger.warning("could not record the worker's shutdown", exc_info=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
            except Exception:
                logger.warning("heartbeat failed; retrying in %ss", self.interval_s,
                               exc_info=True)


def run_worker(*, concurrency: int | None = None, pool: str = "prefork",
               settings: WorkerSettings | None = None) -> None:
    settings = settings or get_worker_settings()
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.worker_name == os.uname().nodename:
        settings.worker_name = f"{settings.worker_name}-{os.getpid()}"
    configure_celery(settings)
    import compiler_worker.tasks  # noqa: F401  (registers the task on celery_app)

    runner = JobRunner(settings)
    keys = fingerprint_keys(runner.fingerprint)
    if not keys:
        raise SystemExit(f"no registered backend supports this machine: {runner.fingerprint}")
    queues = [queue_for(k) for k in keys]
    heartbeat = Heartbeat(runner, keys)
    worker_ready.connect(lambda **_: heartbeat.start(), weak=False)
    worker_shutdown.connect(lambda **_: heartbeat.stop(), weak=False)
    logger.info("worker %s consumes %s", settings.worker_name, queues)
    celery_app.worker_main([
        "worker",
        "--queues", ",".join(queues),
        "--concurrency", str(concurrency or settings.worker_concurrency),
        "--pool", pool,
        "--hostname", f"{settings.worker_name}@%h",
        "--loglevel", settings.log_level,
        "--without-gossip", "--without-mingle",
    ])

"""Compiler-worker configuration: the control-plane settings plus the worker's own."""

from __future__ import annotations

import socket
import uuid
from functools import lru_cache
from pathlib import Path

from pydantic import Field, PrivateAttr

from services.config import KilnSettings


class WorkerSettings(KilnSettings):
    #: Name reported on jobs; default ``<hostname>-<pid>`` is filled by the CLI.
    worker_name: str = Field(default_factory=socket.gethostname)
    #: Scratch space for builds; each job gets its own folder, removed afterwards.
    worker_workdir: Path | None = None
    #: Declared hardware (JSON of HardwareFingerprint) instead of detection.
    fingerprint_file: Path | None = None
    #: Jobs one worker builds at once (Celery processes).
    worker_concurrency: int = Field(1, ge=1)
    #: Seconds between heartbeats. The control plane counts a worker lost after three missed
    #: beats and hands its running job to another worker.
    worker_heartbeat_s: float = Field(10.0, gt=0)
    #: Address space of the child that builds a job (parses the model, runs plugin code,
    #: builds, verifies, benchmarks); past it the job fails with ``resource_limit``. Imports
    #: take under 1 GiB; the rest is the model's (several copies of its weights).
    sandbox_memory_bytes: int = Field(16 * 1024**3, ge=1024**3)
    #: CPU seconds of that child; past them the job fails with ``resource_limit``.
    sandbox_cpu_s: int = Field(4 * 3600, ge=1)
    #: Wall-clock seconds of that child; past them it is killed and the job fails with
    #: ``timed_out``.
    sandbox_timeout_s: float = Field(2 * 3600, gt=0)
    #: Largest file that child may write (an engine, an optimized model).
    sandbox_file_bytes: int = Field(8 * 1024**3, ge=1024**2)
    #: Open files of that child.
    sandbox_open_files: int = Field(4096, ge=64)
    #: Port of the worker's `/healthz` and `/readyz` (broker, database, store); unset: none.
    worker_health_port: int | None = Field(None, ge=0, le=65535)
    #: Address the worker's health endpoint listens on.
    worker_health_host: str = "127.0.0.1"
    #: The control plane's URL: the worker publishes builds through it.
    worker_api_url: str | None = None
    #: A worker token (role ``worker``, scoped to this machine's fingerprint keys): the only
    #: credential a worker needs to publish; it holds no signing key.
    worker_token: str | None = None

    #: This process's instance id, new at every start: with ``worker_name`` it is the
    #: worker's identity, so a restart under the same name is told apart from the old one.
    _instance: str = PrivateAttr(default_factory=lambda: uuid.uuid4().hex)

    @property
    def instance(self) -> str:
        return self._instance

    @property
    def workdir(self) -> Path:
        return (self.worker_workdir or self.home / "work").resolve()


@lru_cache
def get_worker_settings() -> WorkerSettings:
    return WorkerSettings()

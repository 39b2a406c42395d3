"""Compiler-worker configuration: the control-plane settings plus the worker's own."""

from __future__ import annotations

import socket
from functools import lru_cache
from pathlib import Path

from pydantic import Field

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

    @property
    def workdir(self) -> Path:
        return (self.worker_workdir or self.home / "work").resolve()


@lru_cache
def get_worker_settings() -> WorkerSettings:
    return WorkerSettings()

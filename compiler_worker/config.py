"""Compiler-worker configuration: the settings it shares with the control plane (none a
secret) plus its own. A worker reads no database URL, store credential, signing key or JWT
secret: it speaks to the control plane over HTTP with a worker token
(``KILN_WORKER_API_URL``, ``KILN_WORKER_TOKEN``), and to the broker."""

from __future__ import annotations

import logging
import socket
import uuid
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Self

from pydantic import Field, PrivateAttr, field_validator, model_validator
from pydantic_settings import NoDecode

from schemas.errors import ConfigError
from schemas.settings import SharedSettings

logger = logging.getLogger(__name__)

#: Variables that carry the control plane's secrets or store credentials: none belongs in a
#: worker's environment (``check_no_secrets``).
CONTROL_PLANE_SECRETS = (
    "KILN_SECRET_KEY", "KILN_DATABASE_URL", "KILN_SIGNING_KEY_PATH", "KILN_ROOT_KEY_PATH",
    "KILN_STORE_URI", "KILN_S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
)


class WorkerSettings(SharedSettings):
    #: Name reported on jobs; default ``<hostname>-<pid>`` is filled by the CLI.
    worker_name: str = Field(default_factory=socket.gethostname)
    #: Scratch space for builds; each job gets its own folder, removed afterwards.
    worker_workdir: Path | None = None
    #: Declared hardware (JSON of HardwareFingerprint) instead of detection.
    fingerprint_file: Path | None = None
    #: Nodes of another architecture this worker cross-compiles for, comma-separated: an
    #: architecture (``aarch64``) or a fingerprint file each (``compiler_worker.cross``). Their
    #: keys are consumed and advertised beside the worker's own; their engines are verified by
    #: the node's golden check, never run or timed here.
    worker_cross_targets: Annotated[list[str], NoDecode] = Field(default_factory=list)
    #: Jobs one worker builds at once (Celery processes).
    worker_concurrency: int = Field(1, ge=1)
    #: Seconds between heartbeats. The control plane counts a worker lost after three missed
    #: beats and hands its running job to another worker.
    worker_heartbeat_s: float = Field(10.0, gt=0)
    #: Address space of the child that builds a job (parses the model, runs plugin code,
    #: builds, verifies, benchmarks); past it the job fails with ``resource_limit``. The
    #: toolchain's imports take a small share (``bench/sandbox.py`` prints the least address
    #: space each needs); the rest is the model's (several copies of its weights).
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
    #: The host-wide lock file builds take turns on to time engines (one benchmark at a time
    #: per host: every worker and ``kiln agent --build`` there, and ``kiln compile``, must
    #: name the same file); unset: ``/dev/shm/kiln-benchmark.lock`` (else in the system's
    #: temporary folder). A sandboxed build only reads it: keep it outside ``/tmp``, which a
    #: build sees as its own.
    benchmark_lock: Path | None = None
    #: Port of the worker's `/healthz` and `/readyz` (broker, API); unset: none.
    worker_health_port: int | None = Field(None, ge=0, le=65535)
    #: Address the worker's health endpoint listens on.
    worker_health_host: str = "127.0.0.1"
    #: The control plane's URL: the worker claims jobs, fetches their inputs and publishes
    #: builds through it.
    worker_api_url: str | None = None
    #: A worker token (role ``worker``, scoped to this machine's fingerprint keys): the only
    #: credential a worker holds.
    worker_token: str | None = None

    #: This process's instance id, new at every start: with ``worker_name`` it is the
    #: worker's identity, so a restart under the same name is told apart from the old one.
    _instance: str = PrivateAttr(default_factory=lambda: uuid.uuid4().hex)

    #: Whether the broker was left to its embedded default (not given in the environment).
    _broker_defaulted: bool = PrivateAttr(default=False)

    @field_validator("worker_cross_targets", mode="before")
    @classmethod
    def _cross_targets(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @model_validator(mode="after")
    def _fill_defaults(self) -> Self:
        if self.broker_url is None:
            self._broker_defaulted = True
            self.broker_url = "filesystem://"
        return self

    def check_explicit(self) -> None:
        """In production, refuse the server-less broker unless it is named."""
        if self.env != "dev" and self._broker_defaulted:
            raise ConfigError(
                "KILN_ENV=production needs the broker named: set KILN_BROKER_URL (e.g. "
                "redis://redis:6379/0), or set KILN_ENV=dev to use the embedded one under "
                f"KILN_HOME={self.home}")

    def check_no_secrets(self, environ: Mapping[str, str]) -> None:
        """A worker holds no secret of the control plane: refuse (production) or warn about
        (dev) any of ``CONTROL_PLANE_SECRETS`` in its environment, which a plugin or a parser
        bug in the worker's reach could read."""
        found = sorted(name for name in CONTROL_PLANE_SECRETS if environ.get(name))
        if not found:
            return
        message = (f"a compiler worker holds no control-plane secret or store credential, but "
                   f"its environment sets {', '.join(found)}; unset them (a worker needs "
                   f"only KILN_BROKER_URL, KILN_WORKER_API_URL and KILN_WORKER_TOKEN)")
        if self.env != "dev":
            raise ConfigError(message, variables=found)
        logger.warning("%s", message)

    @property
    def instance(self) -> str:
        return self._instance

    @property
    def workdir(self) -> Path:
        return (self.worker_workdir or self.home / "work").resolve()


@lru_cache
def get_worker_settings() -> WorkerSettings:
    return WorkerSettings()

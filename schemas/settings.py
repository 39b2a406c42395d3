"""The settings every side shares (none a secret): ``KILN_ENV``, ``KILN_HOME``, the broker,
logging, the job time limits and the sandbox switches. The control plane's settings
(``services.config.KilnSettings``) and a compiler worker's (``compiler_worker.config``) extend
this class; neither side imports the other's. Reading the environment is pydantic-settings'
work at construction, not this module's at import."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class SharedSettings(BaseSettings):
    """The settings the control plane and the compiler workers share: none is a secret.
    The control plane's (``services.config``) and a worker's (``compiler_worker.config``)
    each extend these, so a worker process never reads a database URL, a store credential,
    a signing key or the JWT secret."""

    model_config = SettingsConfigDict(env_prefix="KILN_", env_file=None, extra="ignore")

    #: ``production`` refuses to start with the default secret, with a database, broker or
    #: store left to its embedded default, or with an unknown ``KILN_*`` variable; ``dev``
    #: allows all three (an unknown variable is then a warning).
    env: Literal["dev", "production"] = "production"
    #: State folder of the embedded stack; the services' defaults live under it.
    home: Path = Path(".kiln")
    #: Default: kombu's filesystem transport under ``home`` (no server). Production: redis://.
    broker_url: str | None = None
    #: Python logging level of the API and workers.
    log_level: str = "INFO"
    #: A job's soft time limit is its tuning budget plus this margin plus the publish retry
    #: budget, seconds; past it the job fails `timed_out`, naming its stage.
    job_time_margin_s: float = Field(600.0, gt=0)
    #: Seconds after the soft time limit before the build process is killed (hard limit);
    #: the sweep fails a job still `running` that long after its hard limit.
    job_kill_grace_s: float = Field(60.0, gt=0)
    #: How long a worker keeps retrying the publish of a finished build (the API, or its store
    #: or database, unreachable), with backoff, before the job fails; its outputs are kept
    #: meanwhile.
    publish_retry_budget_s: float = Field(600.0, ge=0)
    #: Confine sandboxed children (upload inspection in the API, builds in workers) to their
    #: scratch folder with Landlock where the kernel has it (Linux 5.13+); off, or where the
    #: kernel lacks it, a warning says what is not enforced.
    sandbox_landlock: bool = True
    #: Give sandboxed children a network namespace of their own (no network) where user
    #: namespaces are allowed.
    sandbox_network_isolation: bool = True
    #: Fork sandboxed children from a fork server per entry point, which imported their
    #: libraries once (a fresh interpreter of its own, holding no secret), instead of
    #: starting a fresh interpreter for each; their confinement is the same.
    sandbox_fork_server: bool = True

    @property
    def broker_folder(self) -> Path:
        """Where the server-less broker keeps its messages."""
        return self.home.resolve() / "broker"

    def job_time_limits(self, tuning_budget_s: float) -> tuple[float, float]:
        """(soft, hard) time limits in seconds of a job with this tuning budget."""
        soft = tuning_budget_s + self.job_time_margin_s + self.publish_retry_budget_s
        return soft, soft + self.job_kill_grace_s

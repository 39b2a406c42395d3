"""Control-plane configuration: one pydantic-settings class, read once, validated at start-up.

Every variable is ``KILN_<NAME>``; nothing else in Kiln reads ``os.environ`` for its own
settings. Paths default to ``KILN_HOME`` (``./.kiln``), the embedded stack's state folder.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal, Self

from pydantic import Field, PrivateAttr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.errors import ConfigError

DEFAULT_SECRET = "change-me"

#: Settings production refuses to default, with an example of each.
EXPLICIT_IN_PRODUCTION = {
    "database_url": "e.g. postgresql+psycopg://kiln:PASSWORD@db:5432/kiln",
    "broker_url": "e.g. redis://redis:6379/0",
    "store_uri": "e.g. s3://bucket/prefix or file:///srv/kiln/store",
}


class KilnSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KILN_", env_file=None, extra="ignore")

    #: ``production`` refuses to start with the default secret, with a database, broker or
    #: store left to its embedded default, or with an unknown ``KILN_*`` variable; ``dev``
    #: allows all three (an unknown variable is then a warning).
    env: Literal["dev", "production"] = "production"
    #: State folder of the embedded stack; the services' defaults live under it.
    home: Path = Path(".kiln")

    #: Signs API tokens; at least 32 characters (e.g. `openssl rand -hex 32`) outside dev.
    secret_key: str = DEFAULT_SECRET
    #: Default: a SQLite file under ``home``. Production: ``postgresql+psycopg://...``.
    database_url: str | None = None
    #: ``file:///abs/dir`` or ``s3://bucket/prefix``. Default: ``home/store``.
    store_uri: str | None = None
    #: The S3 endpoint the control plane and workers use (default: AWS).
    s3_endpoint_url: str | None = None
    #: Region of the S3 bucket (used to sign requests).
    s3_region: str = "us-east-1"
    #: Default: kombu's filesystem transport under ``home`` (no server). Production: redis://.
    broker_url: str | None = None

    #: Ed25519 private key (PEM) that signs manifests; its public half is ``<path>.pub``.
    #: ``kiln keygen`` writes a pair (``kiln up`` does for the embedded stack).
    signing_key_path: Path | None = None

    #: Largest request body the API accepts (a model upload).
    max_upload_bytes: int = Field(2 * 1024**3, ge=1)
    #: Largest ``.npz`` dataset accepted, as uploaded and as its arrays unpack (a dataset is
    #: loaded whole into a worker's memory).
    max_dataset_bytes: int = Field(512 * 1024**2, ge=1)
    #: Address `kiln api` listens on.
    api_host: str = "127.0.0.1"
    #: Port `kiln api` listens on.
    api_port: int = 8000
    #: Lifetime of presigned download URLs, seconds.
    presign_ttl_s: int = Field(3600, ge=1)
    #: Python logging level of the API and workers.
    log_level: str = "INFO"
    #: How often agents are told to heartbeat, seconds.
    agent_heartbeat_s: float = Field(5.0, gt=0)
    #: How often the API looks for running jobs whose worker stopped heartbeating, seconds
    #: (0: never). Such a job is queued again, or fails with ``worker_lost`` once it has been
    #: tried ``max_job_attempts`` times.
    job_sweep_s: float = Field(10.0, ge=0)
    #: Attempts before a job whose worker was lost fails with `worker_lost`.
    max_job_attempts: int = Field(3, ge=1)

    #: The services left to their embedded defaults (not given in the environment).
    _defaulted: frozenset[str] = PrivateAttr(default=frozenset())

    @model_validator(mode="after")
    def _fill_defaults(self) -> Self:
        self._defaulted = frozenset(
            name for name in (*EXPLICIT_IN_PRODUCTION, "signing_key_path")
            if getattr(self, name) is None
        )
        home = self.home.resolve()
        if self.database_url is None:
            self.database_url = f"sqlite:///{home / 'kiln.db'}"
        if self.store_uri is None:
            self.store_uri = (home / "store").as_uri()
        if self.broker_url is None:
            self.broker_url = "filesystem://"
        if self.signing_key_path is None:
            self.signing_key_path = home / "signing.key"
        return self

    @property
    def defaulted(self) -> frozenset[str]:
        """Fields filled from ``home`` because they were not given."""
        return self._defaulted

    @property
    def broker_folder(self) -> Path:
        """Where the server-less broker keeps its messages."""
        return self.home.resolve() / "broker"

    def check_secure(self) -> None:
        """Refuse to serve with the well-known default secret outside dev mode."""
        if self.secret_key == DEFAULT_SECRET and self.env != "dev":
            raise ConfigError(
                "KILN_SECRET_KEY is the default value; set a real secret (for example "
                "`openssl rand -hex 32`), or set KILN_ENV=dev for local experiments"
            )
        if len(self.secret_key) < 32 and self.env != "dev":
            raise ConfigError("KILN_SECRET_KEY must be at least 32 characters outside dev mode")

    def check_explicit(self) -> None:
        """In production, refuse the embedded defaults (SQLite, a local folder, the
        filesystem broker): each must be named, so a typo never falls back silently."""
        if self.env == "dev":
            return
        missing = [name for name in EXPLICIT_IN_PRODUCTION if name in self._defaulted]
        if missing:
            given = ", ".join(f"KILN_{name.upper()} ({EXPLICIT_IN_PRODUCTION[name]})"
                              for name in missing)
            raise ConfigError(
                f"KILN_ENV=production needs every service named, and these were not set: "
                f"{given}; set them, or set KILN_ENV=dev to use the embedded defaults "
                f"under KILN_HOME={self.home}"
            )


@lru_cache
def get_settings() -> KilnSettings:
    return KilnSettings()

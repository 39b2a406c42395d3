"""Control-plane configuration: one pydantic-settings class, read once, validated at start-up.

Every variable is ``KILN_<NAME>``; nothing else in Kiln reads ``os.environ`` for its own
settings. Paths default to ``KILN_HOME`` (``./.kiln``), the embedded stack's state folder.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal, Self

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.errors import ConfigError

DEFAULT_SECRET = "change-me"


class KilnSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KILN_", env_file=None, extra="ignore")

    #: ``dev`` allows the default secret; anything else refuses to start with it.
    env: Literal["dev", "production"] = "production"
    home: Path = Path(".kiln")

    secret_key: str = DEFAULT_SECRET
    #: Default: a SQLite file under ``home``. Production: ``postgresql+psycopg://...``.
    database_url: str | None = None
    #: ``file:///abs/dir`` or ``s3://bucket/prefix``. Default: ``home/store``.
    store_uri: str | None = None
    s3_endpoint_url: str | None = None
    s3_region: str = "us-east-1"
    #: Default: kombu's filesystem transport under ``home`` (no server). Production: redis://.
    broker_url: str | None = None

    #: Ed25519 private key (PEM) that signs manifests. Workers need it; created by ``kiln up``.
    signing_key_path: Path | None = None
    #: Ed25519 public keys (PEM files) trusted when verifying manifests.
    trusted_keys: list[Path] = Field(default_factory=list)

    max_upload_bytes: int = Field(2 * 1024**3, ge=1)
    #: Largest ``.npz`` dataset accepted, as uploaded and as its arrays unpack (a dataset is
    #: loaded whole into a worker's memory).
    max_dataset_bytes: int = Field(512 * 1024**2, ge=1)
    api_host: str = "127.0.0.1"
    api_port: int = 8000
    #: Lifetime of presigned download URLs, seconds.
    presign_ttl_s: int = Field(3600, ge=1)
    log_level: str = "INFO"
    #: How often agents are told to heartbeat, seconds.
    agent_heartbeat_s: float = Field(5.0, gt=0)
    #: How often the API looks for running jobs whose worker stopped heartbeating, seconds
    #: (0: never). Such a job is queued again, or fails with ``worker_lost`` once it has been
    #: tried ``max_job_attempts`` times.
    job_sweep_s: float = Field(10.0, ge=0)
    max_job_attempts: int = Field(3, ge=1)

    @model_validator(mode="after")
    def _fill_defaults(self) -> Self:
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


@lru_cache
def get_settings() -> KilnSettings:
    return KilnSettings()

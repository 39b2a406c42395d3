"""The protocol between runtime agents and the control plane (HTTP, JSON)."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from schemas.deployments import LABEL_KEY_PATTERN
from schemas.errors import ErrorBody
from schemas.fingerprint import HardwareFingerprint

AGENT_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


class AgentRegistration(BaseModel):
    """``POST /v1/agents``: an agent introduces itself (again after each restart)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=AGENT_NAME_PATTERN)
    labels: dict[str, str] = Field(default_factory=dict)
    fingerprint: HardwareFingerprint
    #: Backend name → the fingerprint key this node has for it (computed by the agent's
    #: executors, which know what their engines need).
    fingerprint_keys: dict[str, str]
    #: Backend name → the coarser compatibility keys this node can also run (see
    #: ``ArtifactManifest.compatibility_key``).
    compatibility_keys: dict[str, list[str]] = Field(default_factory=dict)
    #: Where the agent's inference server listens, if it runs one.
    serve_url: str | None = None

    def model_post_init(self, _: object) -> None:
        import re

        for key in self.labels:
            if not re.match(LABEL_KEY_PATTERN, key):
                raise ValueError(f"label key {key!r} must match {LABEL_KEY_PATTERN}")


class ModelState(StrEnum):
    #: Desired, but no engine exists for this node yet (a build is queued).
    PENDING = "pending"
    DOWNLOADING = "downloading"
    LOADING = "loading"
    SERVING = "serving"
    #: The desired artifact could not be loaded; the previous one (if any) keeps serving.
    FAILED = "failed"


class ModelStatus(BaseModel):
    """What an agent reports for one deployment."""

    model_config = ConfigDict(extra="forbid")

    deployment: str
    state: ModelState
    #: The artifact serving requests now (``None`` before the first one loads).
    artifact_id: str | None = None
    #: The artifact the agent is moving to, when it differs from ``artifact_id``.
    target_artifact_id: str | None = None
    #: How the serving artifact was resolved for this node (``exact``, ``compatible``,
    #: ``fallback``).
    tier: str | None = None
    error: ErrorBody | None = None
    requests: int = 0
    p50_ms: float | None = None


class AgentHeartbeat(BaseModel):
    """``POST /v1/agents/{name}/heartbeat``."""

    model_config = ConfigDict(extra="forbid")

    models: list[ModelStatus] = Field(default_factory=list)


class DesiredModel(BaseModel):
    """One model the control plane wants an agent to serve."""

    model_config = ConfigDict(extra="forbid")

    deployment: str
    deployment_id: str
    generation: int
    model_id: str
    options_digest: str
    backend: str
    #: The engine to run; ``None`` while no artifact exists for this node's key.
    artifact_id: str | None = None
    #: ``exact`` (built for this node's key), ``compatible`` (same model and options, built
    #: elsewhere, and its compatibility key is one this node has), ``fallback`` (a portable
    #: engine of the same model built with other options), or ``none`` (nothing runs here
    #: yet). Below ``exact``, ``job_id`` names the build of the exact engine; at ``exact``,
    #: the build of its successor when a plugin it uses has a newer version.
    tier: str = "none"
    #: The compile job building this node's engine, when one is in flight.
    job_id: str | None = None


class DesiredState(BaseModel):
    """The answer to a registration or heartbeat."""

    model_config = ConfigDict(extra="forbid")

    agent: str
    models: list[DesiredModel]
    heartbeat_s: float


class AgentInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    labels: dict[str, str]
    fingerprint: HardwareFingerprint
    fingerprint_keys: dict[str, str]
    compatibility_keys: dict[str, list[str]] = Field(default_factory=dict)
    serve_url: str | None
    registered_at: datetime
    last_seen: datetime
    alive: bool
    models: list[ModelStatus]

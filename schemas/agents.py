"""The protocol between runtime agents and the control plane (HTTP, JSON)."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from schemas._canonical import canonical_json, sha256_hex
from schemas._versioned import validate_versioned, version_field
from schemas.deployments import LABEL_KEY_PATTERN, BatchingPolicy
from schemas.errors import ErrorBody, ErrorCode
from schemas.fingerprint import HardwareFingerprint

#: The desired-state schema this Kiln writes (see ``schemas._versioned``).
#: 1.1: ``DesiredModel.choice`` (why this engine; agents of 1.0 drop it).
#: 1.2: ``DesiredModel.batching`` (the deployment's dynamic batching; older agents drop it
#: and serve every request alone).
DESIRED_STATE_SCHEMA_VERSION = "1.2"

AGENT_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
#: A fingerprint key (it names a queue, ``build.<key>``) and a compatibility key.
FINGERPRINT_KEY_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,199}$"
#: A backend's name, as executors register it.
BACKEND_PATTERN = r"^[a-z][a-z0-9_-]{0,31}$"
LABEL_VALUE_PATTERN = r"^[A-Za-z0-9._:/@+-]{0,128}$"
#: Bounds of what one agent may report.
MAX_LABELS = 64
MAX_BACKENDS = 16
MAX_COMPATIBILITY_KEYS = 32
MAX_MODELS = 256
#: Bounds of a reported fingerprint (a detected one is far inside them).
MAX_CPU_FEATURES = 1024
MAX_ACCELERATORS = 64
MAX_RUNTIMES = 64
MAX_FINGERPRINT_TEXT = 256

FingerprintKey = Annotated[str, Field(pattern=FINGERPRINT_KEY_PATTERN)]
Backend = Annotated[str, Field(pattern=BACKEND_PATTERN)]
LabelKey = Annotated[str, Field(pattern=LABEL_KEY_PATTERN)]
LabelValue = Annotated[str, Field(pattern=LABEL_VALUE_PATTERN)]


class AgentRegistration(BaseModel):
    """``POST /v1/agents``: an agent introduces itself (again after each restart)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=AGENT_NAME_PATTERN)
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=MAX_LABELS)
    fingerprint: HardwareFingerprint
    #: Backend name → the fingerprint key this node has for it (computed by the agent's
    #: executors, which know what their engines need; the control plane derives them again
    #: from ``fingerprint`` and refuses a key its executors do not).
    fingerprint_keys: dict[Backend, FingerprintKey] = Field(max_length=MAX_BACKENDS)
    #: Backend name → the coarser compatibility keys this node can also run (see
    #: ``ArtifactManifest.compatibility_key``).
    compatibility_keys: dict[Backend, Annotated[list[FingerprintKey], Field(
        max_length=MAX_COMPATIBILITY_KEYS)]] = Field(default_factory=dict,
                                                     max_length=MAX_BACKENDS)
    #: Where the agent's inference server listens, if it runs one.
    serve_url: str | None = Field(None, max_length=1024, pattern=r"^https?://\S+$")

    @model_validator(mode="after")
    def _bounded_fingerprint(self) -> AgentRegistration:
        """A fingerprint is free-form where the hardware is; it is still bounded."""
        fp = self.fingerprint
        problems = []
        if len(fp.cpu.features) > MAX_CPU_FEATURES:
            problems.append(f"{len(fp.cpu.features)} CPU features (at most {MAX_CPU_FEATURES})")
        if len(fp.accelerators) > MAX_ACCELERATORS:
            problems.append(f"{len(fp.accelerators)} accelerators (at most {MAX_ACCELERATORS})")
        if len(fp.runtimes) > MAX_RUNTIMES:
            problems.append(f"{len(fp.runtimes)} runtimes (at most {MAX_RUNTIMES})")
        texts = [fp.os, fp.source, fp.cpu.arch, fp.cpu.vendor, fp.cpu.model, *fp.cpu.features,
                 *(v or "" for v in fp.runtimes.values()),
                 *(t for a in fp.accelerators
                   for t in (a.kind, a.name, a.compute_capability, a.driver))]
        longest = max((len(t) for t in texts), default=0)
        if longest > MAX_FINGERPRINT_TEXT:
            problems.append(f"a text field of {longest} characters (at most "
                            f"{MAX_FINGERPRINT_TEXT})")
        if problems:
            raise ValueError("the fingerprint is out of bounds: " + "; ".join(problems))
        return self


class ModelState(StrEnum):
    #: Desired, but no engine exists for this node yet (a build is queued).
    PENDING = "pending"
    DOWNLOADING = "downloading"
    LOADING = "loading"
    SERVING = "serving"
    #: The desired artifact could not be loaded; the previous one (if any) keeps serving.
    FAILED = "failed"


#: Error codes by which an agent refuses an artifact as one this node cannot run, whatever
#: the retries: the control plane then resolves another engine for that agent.
REFUSAL_CODES = frozenset({ErrorCode.FINGERPRINT_MISMATCH, ErrorCode.BACKEND_UNAVAILABLE})
#: The most refusals one status carries (older ones are dropped by the agent first).
MAX_REFUSALS = 16


class Refusal(BaseModel):
    """An artifact this node refused to run, and why (``REFUSAL_CODES``)."""

    model_config = ConfigDict(extra="forbid")

    artifact_id: str = Field(max_length=128)
    code: ErrorCode
    message: str = Field("", max_length=2000)
    #: The node's fingerprint keys when it refused: the control plane honours the refusal
    #: only while the agent reports the same keys (a node whose OpenVINO or CPU changed may
    #: run the artifact now).
    fingerprint_keys: dict[Backend, FingerprintKey] = Field(default_factory=dict,
                                                            max_length=MAX_BACKENDS)

    @field_validator("code")
    @classmethod
    def _a_refusal(cls, code: ErrorCode) -> ErrorCode:
        if code not in REFUSAL_CODES:
            raise ValueError(f"a refusal's code is one of {sorted(REFUSAL_CODES)}, not "
                             f"{code.value!r}")
        return code


class ModelStatus(BaseModel):
    """What an agent reports for one deployment."""

    model_config = ConfigDict(extra="forbid")

    deployment: str = Field(max_length=128)
    state: ModelState
    #: The artifact serving requests now (``None`` before the first one loads).
    artifact_id: str | None = Field(None, max_length=128)
    #: The artifact the agent is moving to, when it differs from ``artifact_id``.
    target_artifact_id: str | None = Field(None, max_length=128)
    #: How the serving artifact was resolved for this node (``exact``, ``compatible``,
    #: ``fallback``), or ``previous``: a restarted agent serving what it served before while
    #: the desired artifact cannot be fetched.
    tier: str | None = Field(None, max_length=32)
    error: ErrorBody | None = None
    #: Artifacts of this deployment the node refused as unable to run them (typed), so the
    #: control plane gives it the next engine rather than the same one again.
    refused: list[Refusal] = Field(default_factory=list, max_length=MAX_REFUSALS)
    requests: int = 0
    p50_ms: float | None = None


class TrustStatus(BaseModel):
    """Where an agent stands with the signed desired state it follows."""

    model_config = ConfigDict(extra="forbid")

    #: Version of the desired state it applies (the highest it has accepted).
    desired_version: int | None = None
    #: When that desired state expires; past it the agent is stale.
    expires: datetime | None = None
    #: True once the desired state it follows has expired: it keeps serving what it has,
    #: and takes no new orders until fresh signed metadata arrives.
    stale: bool = False
    #: The version of the root metadata it trusts (``None`` when it pins keys instead).
    root_version: int | None = None
    #: Why the last desired state it received was refused (rollback, expiry, another agent,
    #: an untrusted key), if it was.
    refused: ErrorBody | None = None


class AgentHeartbeat(BaseModel):
    """``POST /v1/agents/{name}/heartbeat``."""

    model_config = ConfigDict(extra="forbid")

    models: list[ModelStatus] = Field(default_factory=list, max_length=MAX_MODELS)
    trust: TrustStatus | None = None


class EngineCandidate(BaseModel):
    """A verified engine the agent could run, as the control plane weighed it."""

    model_config = ConfigDict(extra="forbid")

    artifact_id: str
    backend: str
    tier: str
    #: The p50 latency recorded when it was built (on the build host); ``None`` when none was.
    p50_ms: float | None = None


class EngineChoice(BaseModel):
    """Why the control plane gave an agent this engine among those it could run
    (``services/api/engine_choice.py``)."""

    model_config = ConfigDict(extra="forbid")

    #: ``fastest`` (the lowest recorded p50 of its tier), ``tie`` (several share it: the
    #: agent's backend preference among them), ``preference`` (a candidate of the tier has no
    #: recorded p50: the agent's backend preference), ``only`` (the one candidate), or
    #: ``refused`` (none: the agent refused every engine it could have had; ``message`` names
    #: them and why).
    reason: str
    #: The tier it came from: ``exact`` before ``compatible`` before ``fallback``.
    tier: str
    #: Every candidate weighed, the chosen one first.
    candidates: list[EngineCandidate] = Field(default_factory=list)
    #: Backends the agent has and the model was planned for that offer no engine (yet), and
    #: why: ``building``, ``queued``, ``failed: <error code>``...
    missing: dict[str, str] = Field(default_factory=dict)
    #: The same in words.
    message: str = ""


class DesiredModel(BaseModel):
    """One model the control plane wants an agent to serve."""

    model_config = ConfigDict(extra="forbid")

    deployment: str
    deployment_id: str
    generation: int
    model_id: str
    options_digest: str
    backend: str
    #: The node's fingerprint key for ``backend``: an ``exact`` artifact must carry it.
    fingerprint_key: str | None = None
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
    #: That job failed: a new build is queued from this time on (backoff doubles with each
    #: failure in a row, ``KILN_BUILD_RETRY_BASE_S`` up to ``KILN_BUILD_RETRY_MAX_S``).
    retry_at: datetime | None = None
    #: The agent is admitted to this rollout's new model: it reports the rollout's gates
    #: (``POST /v1/rollouts/{id}/reports``) after loading the engine.
    rollout_id: str | None = None
    #: Why this engine, when the control plane weighed several (one per backend it planned
    #: for the agent): schema 1.1.
    choice: EngineChoice | None = None
    #: The deployment's dynamic-batching policy (schema 1.2); ``None``: no batching.
    batching: BatchingPolicy | None = None


class DesiredState(BaseModel):
    """What an agent should serve: the payload of the signed envelope that answers a
    registration or heartbeat (``SignedEnvelope``)."""

    model_config = ConfigDict(extra="forbid")

    schema_version: str = DESIRED_STATE_SCHEMA_VERSION
    #: The agent it is for; an agent refuses desired state naming another.
    agent: str
    models: list[DesiredModel]
    heartbeat_s: float
    #: Grows with every desired state the control plane issues (microseconds of issue time);
    #: an agent refuses one lower than the highest it has accepted (rollback).
    version: int = 0
    issued_at: datetime | None = None
    #: After this the agent keeps serving what it has and reports itself stale.
    expires: datetime | None = None

    @field_validator("schema_version", mode="before")
    @classmethod
    def _schema(cls, value: object) -> str:
        return version_field(value, what="a desired state")

    def content_digest(self) -> str:
        """sha256 of what the state asks for (agent, models, heartbeat period), leaving out
        what every issue changes (version, issue time, expiry). The long-poll's ``after``: an
        agent sends the digest of the state it holds, and the control plane answers when its
        own differs."""
        return sha256_hex(canonical_json(self.model_dump(
            mode="json", include={"schema_version", "agent", "models", "heartbeat_s"})))


def parse_desired_state(data: dict) -> DesiredState:
    """A decoded desired state, honouring its ``schema_version``."""
    return validate_versioned(DesiredState, data, current=DESIRED_STATE_SCHEMA_VERSION,
                              what="desired state")


class EnvelopeSignature(BaseModel):
    keyid: str
    #: base64 Ed25519 signature over DSSE's pre-authentication encoding of the payload.
    sig: str


class SignedEnvelope(BaseModel):
    """A DSSE envelope: ``payload`` (base64 of the exact bytes signed), ``payloadType`` and
    the signatures. Registration and heartbeats answer with one whose payload is a
    ``DesiredState``; stored manifests are one too."""

    payload: str
    payloadType: str
    signatures: list[EnvelopeSignature]


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
    #: What the agent last said of its signed desired state (``stale`` once it expired).
    trust: TrustStatus | None = None

"""Runtime-agent configuration: one pydantic-settings class, ``KILN_AGENT_<NAME>`` variables.

Lists and maps are read from the environment either as JSON or in the short form the CLI
takes: ``KILN_AGENT_LABELS=zone=a,tier=gpu``, ``KILN_AGENT_TRUSTED_KEYS=/k/a.pub,/k/b.pub``.
"""

from __future__ import annotations

import json
import re
import socket
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from artifact_store.http_guard import ConnectionLimits
from schemas.agents import AGENT_NAME_PATTERN
from schemas.deployments import LABEL_KEY_PATTERN
from schemas.errors import ConfigError

if TYPE_CHECKING:
    from runtime_agent.trust import AgentTrust

GiB = 1024**3
MiB = 1024**2


def parse_labels(text: str) -> dict[str, str]:
    """``"zone=a,tier=gpu"`` (or a JSON object) → ``{"zone": "a", "tier": "gpu"}``.

    Raises ``ConfigError`` for a pair without ``=`` or a key outside ``LABEL_KEY_PATTERN``.
    """
    text = text.strip()
    if text.startswith("{"):
        try:
            labels = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"labels {text!r} are not a JSON object: {exc}") from exc
        if not isinstance(labels, dict):
            raise ConfigError(f"labels {text!r} must be a JSON object of strings")
        pairs = [(str(k), str(v)) for k, v in labels.items()]
    else:
        pairs = []
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = item.partition("=")
            if not sep:
                raise ConfigError(f"label {item!r} must be written key=value (in {text!r})")
            pairs.append((key.strip(), value.strip()))
    for key, _ in pairs:
        if not re.match(LABEL_KEY_PATTERN, key):
            raise ConfigError(f"label key {key!r} must match {LABEL_KEY_PATTERN}")
    return dict(pairs)


def _default_name() -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", socket.gethostname()).strip("-._")
    return name[:128] or "agent"


class AgentSettings(BaseSettings):
    """Everything a runtime agent is told; ``KILN_AGENT_<FIELD>`` in the environment."""

    model_config = SettingsConfigDict(env_prefix="KILN_AGENT_", env_file=None, extra="ignore")

    #: The control plane.
    api_url: str = "http://127.0.0.1:8000"
    #: Bearer token with the ``agent`` role (``kiln token create --role agent --agent NAME``).
    token: str | None = None
    #: The agent's name in the fleet; default: the host name.
    name: str = Field(default_factory=_default_name, pattern=AGENT_NAME_PATTERN)
    #: Matched by deployment selectors.
    labels: Annotated[dict[str, str], NoDecode] = Field(default_factory=dict)
    #: Where pulled artifacts are kept (verified, then activated atomically).
    cache_dir: Path = Path(".kiln/agent-cache")
    #: Least-recently-used artifacts beyond this are evicted (never one in use).
    cache_max_bytes: int = Field(10 * GiB, ge=0)
    #: Heartbeat period until the control plane names its own.
    heartbeat_s: float = Field(5.0, gt=0)
    #: How long each long-poll of the desired state waits for a change, seconds (at most the
    #: control plane's `KILN_DESIRED_STATE_MAX_WAIT_S`); 0: no long-poll, the heartbeat's
    #: answer brings the desired state.
    long_poll_s: float = Field(30.0, ge=0)
    #: Address the inference server (HTTP and gRPC) listens on.
    serve_host: str = "127.0.0.1"
    #: The inference server's port; 0 runs no server.
    serve_port: int = Field(8100, ge=0, le=65535)
    #: The Open Inference Protocol's gRPC port (on ``serve_host``, same models and token);
    #: 0, the default, runs no gRPC server.
    grpc_port: int = Field(0, ge=0, le=65535)
    #: Threads serving gRPC calls. Each call holds its thread while it waits for its engine
    #: call, so this bounds how many gRPC requests the dynamic batcher can gather into one
    #: batch: keep it at least the deployments' maximum batch times their instances.
    grpc_threads: int = Field(64, ge=1, le=4096)
    #: The URL reported to the control plane; default ``http://<serve_host>:<serve_port>``.
    advertise_url: str | None = None
    #: When set, every inference-server route but the health probes needs
    #: ``Authorization: Bearer <token>``. Required when ``serve_host`` is not loopback (the
    #: agent refuses to start without it).
    serve_token: SecretStr | None = None
    #: Seconds a client of the inference server has to send a request's whole head, from
    #: connecting or from the first byte of its next request; past it the connection is
    #: closed (a client trickling its headers holds nothing for long). 0: no bound.
    serve_header_timeout_s: float = Field(10.0, ge=0)
    #: Connections one client address may hold open to the inference server; more are
    #: closed as they open. 0: no bound.
    serve_max_connections_per_client: int = Field(256, ge=0)
    #: Seconds an idle kept-alive connection to the inference server stays open.
    serve_keep_alive_s: float = Field(5.0, gt=0)
    #: A declared ``HardwareFingerprint`` (JSON) instead of detection.
    fingerprint_file: Path | None = None
    #: This agent runs under emulation (qemu-user: ``deploy/arm64/python`` sets it). Its
    #: fingerprint says so (``source`` ``emulated``) and its latencies are never compared
    #: with native ones: its rollout latency results carry no figures, only that they were
    #: emulated.
    emulated: bool = False
    #: Root public keys (Ed25519, PEM files): the agent follows the control plane's root
    #: metadata from them to the current online key, so rotating that key needs no change
    #: here (the embedded stack's is ``$KILN_HOME/root.key.pub``).
    root_keys: Annotated[list[Path], NoDecode] = Field(default_factory=list)
    #: Online public keys (PEM files) trusted directly instead: nothing else signs what this
    #: agent runs, and a rotated key must be configured here by hand.
    trusted_keys: Annotated[list[Path], NoDecode] = Field(default_factory=list)
    #: Largest inference request body (JSON or npz, also after decompression).
    max_body_bytes: int = Field(64 * MiB, ge=1)
    #: Largest JSON in an inference request (a JSON body, or the JSON header of the binary
    #: extension): parsed JSON takes many times its size in memory, so send large tensors as
    #: npz or binary data.
    max_json_bytes: int = Field(16 * MiB, ge=1)
    #: Timeout of each HTTP call to the control plane (and of each blob read).
    request_timeout_s: float = Field(30.0, gt=0)
    #: ``/readyz`` answers 503 once the control plane has been unreachable this long while
    #: nothing is cached to serve (with a cached desired state the agent serves on, ready).
    ready_offline_s: float = Field(30.0, gt=0)
    #: Python logging level of the agent.
    log_level: str = "INFO"
    #: Confine the agent process with Landlock once it has read its token and keys
    #: (``runtime_agent.confine``): custom-op plugins run inside it, so it then reads only the
    #: code it runs and writes only beneath ``cache_dir``. Turn off only to debug.
    confine: bool = True
    #: TCP ports the confined agent may connect to besides the control plane's (``api_url``'s):
    #: the blob store's, where downloads redirect to presigned URLs (e.g. ``443,9000``).
    connect_ports: Annotated[list[int], NoDecode] = [443]

    def connection_limits(self) -> ConnectionLimits:
        """What a client may hold of the inference server before its request is whole."""
        return ConnectionLimits(header_timeout_s=self.serve_header_timeout_s,
                                max_per_client=self.serve_max_connections_per_client,
                                keep_alive_s=self.serve_keep_alive_s)

    @field_validator("labels", mode="before")
    @classmethod
    def _labels(cls, value: Any) -> Any:
        return parse_labels(value) if isinstance(value, str) else value

    @field_validator("connect_ports", mode="before")
    @classmethod
    def _ports(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            return json.loads(text) if text.startswith("[") else [
                int(part) for part in text.split(",") if part.strip()]
        return value

    @field_validator("trusted_keys", "root_keys", mode="before")
    @classmethod
    def _trusted_keys(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            return json.loads(text) if text.startswith("[") else [
                part.strip() for part in text.split(",") if part.strip()
            ]
        return value

    @property
    def serve_url(self) -> str | None:
        """Where the inference server is reachable, or ``None`` when none runs."""
        if self.advertise_url:
            return self.advertise_url.rstrip("/")
        if not self.serve_port:
            return None
        host = self.serve_host
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostname()
        return f"http://{f'[{host}]' if ':' in host else host}:{self.serve_port}"

    def trust(self) -> AgentTrust:
        """The keys, loaded, and the agent's trust record in its cache; ``ConfigError`` when
        no key is given or one cannot load."""
        if not self.trusted_keys and not self.root_keys:
            raise ConfigError(
                "the agent follows only desired state and artifacts that a trusted key "
                "signed, and no trusted key is configured: set KILN_AGENT_ROOT_KEYS (root public "
                "keys, PEM; pass --root-key) or KILN_AGENT_TRUSTED_KEYS (online keys; "
                "--trusted-key). The embedded stack's root key is $KILN_HOME/root.key.pub"
            )
        # Imported here: every ``kiln`` launcher reads these settings' fields to know the
        # agent's variables, and the signing stack (securesystemslib, which imports boto3)
        # would be loaded on each start for nothing.
        from runtime_agent.trust import AgentTrust

        return AgentTrust(self.cache_dir / "trust", root_keys=list(self.root_keys),
                          trusted_keys=list(self.trusted_keys), agent=self.name)


@lru_cache
def get_settings() -> AgentSettings:
    """The agent's settings from the environment, read once."""
    return AgentSettings()

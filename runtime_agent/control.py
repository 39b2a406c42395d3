"""The agent's HTTP client of the control plane.

=====================================  ==========================================
``register(registration)``             ``POST /v1/agents`` → signed desired state (bytes)
``heartbeat(name, beat)``              ``POST /v1/agents/{name}/heartbeat`` → the same
                                       (``minimal``: liveness only, ``None``)
``desired_state(name, after, wait)``   ``GET /v1/agents/{name}/desired-state`` (long-poll)
                                       → the same, or ``None`` when nothing changed
``root_metadata(version)``             ``GET /v1/trust/root/{version}`` → TUF root metadata
``manifest(artifact_id)``              ``GET /v1/artifacts/{id}/manifest`` → the signed
                                       envelope, byte for byte
``download_blob(artifact_id, ref, p)`` ``GET /v1/artifacts/{id}/blobs/{name}`` (Range, 307)
``plugin_bundle(ref, p)``              ``GET /v1/plugins/{name}/{version}`` (size, digest),
                                       then ``GET .../bundle`` (Range, 307)
=====================================  ==========================================

Error responses carry an ``ErrorBody`` and are raised as the ``KilnError`` it names; a control
plane that cannot be reached raises ``ControlPlaneUnreachable`` (transient).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from runtime_agent.download import download
from runtime_agent.errors import ControlPlaneUnreachable, error_from_response
from schemas.agents import AgentHeartbeat, AgentRegistration
from schemas.errors import IntegrityError, KilnError
from schemas.manifest import BlobRef
from schemas.plugins import PluginRef
from schemas.rollouts import RolloutReport

logger = logging.getLogger(__name__)


def _segment(value: str) -> str:
    return quote(value, safe="")


class ControlPlane:
    """A client of the control plane's agent-facing routes, authenticated by a bearer token."""

    def __init__(self, api_url: str, token: str | None, *, timeout_s: float = 30.0) -> None:
        self.api_url = api_url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=self.api_url, headers=headers, timeout=timeout_s)
        #: Follows redirects to the blob store: it never carries the bearer token.
        self._store = httpx.Client(timeout=timeout_s)

    def close(self) -> None:
        self.http.close()
        self._store.close()

    def __enter__(self) -> ControlPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise ControlPlaneUnreachable(
                f"cannot reach the control plane at {self.api_url} ({method} {path}): {exc}",
                api_url=self.api_url,
            ) from exc
        if response.status_code >= 400:
            raise error_from_response(response, f"{method} {path}")
        return response

    def register(self, registration: AgentRegistration) -> bytes:
        """``POST /v1/agents``: introduce this agent; returns what it should serve, as a
        signed envelope (``runtime_agent.trust`` checks it)."""
        return self._call("POST", "/v1/agents", json=registration.model_dump(mode="json")).content

    def report_rollout(self, rollout_id: str, report: RolloutReport) -> None:
        """``POST /v1/rollouts/{id}/reports``: the gates this agent measured on the rollout's
        engine (a failing one halts its cohort at once)."""
        self._call("POST", f"/v1/rollouts/{_segment(rollout_id)}/reports",
                   json=report.model_dump(mode="json"))

    def heartbeat(self, name: str, beat: AgentHeartbeat, *, minimal: bool = False) -> bytes | None:
        """``POST /v1/agents/{name}/heartbeat``: report model states; returns the signed
        desired state. ``minimal`` asks for liveness only (``Prefer: return=minimal``): a
        control plane that honours it answers 204 (``None``), an older one the state."""
        headers = {"Prefer": "return=minimal"} if minimal else None
        response = self._call("POST", f"/v1/agents/{_segment(name)}/heartbeat",
                              json=beat.model_dump(mode="json"), headers=headers)
        return None if response.status_code == 204 else response.content

    def desired_state(self, name: str, *, after: str | None, wait_s: float,
                      key: str | None = None) -> bytes | None:
        """``GET /v1/agents/{name}/desired-state``: the signed desired state once its content
        digest differs from ``after`` (or the online key from ``key``), or ``None`` when it
        kept it for ``wait_s`` seconds."""
        params: dict[str, Any] = {"wait": f"{wait_s:g}"}
        if after is not None:
            params["after"] = after
        if key is not None:
            params["key"] = key
        response = self._call("GET", f"/v1/agents/{_segment(name)}/desired-state",
                              params=params, timeout=self.http.timeout.read + wait_s
                              if self.http.timeout.read is not None else None)
        return None if response.status_code == 204 else response.content

    def root_metadata(self, version: int) -> bytes:
        """Root metadata ``version`` as signed; ``NotFound`` past the latest."""
        return self._call("GET", f"/v1/trust/root/{int(version)}").content

    def manifest(self, artifact_id: str) -> bytes:
        """The stored manifest of ``artifact_id`` (a signed envelope), exactly as stored; the
        caller verifies the signature over these bytes before parsing them."""
        return self._call("GET", f"/v1/artifacts/{_segment(artifact_id)}/manifest").content

    def download_blob(self, artifact_id: str, ref: BlobRef, dest: Path) -> Path:
        """Download blob ``ref`` of ``artifact_id`` to ``dest``, resumably and verified."""
        path = f"/v1/artifacts/{_segment(artifact_id)}/blobs/{_segment(ref.name)}"
        return download(self.http, path, dest, size=ref.size, sha256=ref.sha256,
                        redirect_client=self._store)

    def plugin_bundle(self, ref: PluginRef, dest: Path) -> Path:
        """Download the bundle archive of plugin ``ref`` to ``dest``, resumably, verified
        against ``ref.digest`` (the digest the artifact's signed manifest pins).

        The plugin's record (``GET /v1/plugins/{name}/{version}``) gives the size; a record
        whose digest differs from the ref's raises ``IntegrityError`` before any download.
        """
        path = f"/v1/plugins/{_segment(ref.name)}/{_segment(ref.version)}"
        response = self._call("GET", path)
        try:
            info = response.json()
            digest, size = str(info["digest"]), int(info["size_bytes"])
        except (ValueError, KeyError, TypeError) as exc:
            raise KilnError(f"GET {path} returned no plugin record (digest, size_bytes): {exc}",
                            plugin=ref.name) from exc
        if digest != ref.digest:
            raise IntegrityError(
                f"the control plane's plugin {ref.name} {ref.version} has sha256 {digest}; the "
                f"artifact needs {ref.digest}", plugin=ref.name, expected=ref.digest,
                served=digest,
            )
        return download(self.http, f"{path}/bundle", dest, size=size, sha256=ref.digest,
                        redirect_client=self._store)

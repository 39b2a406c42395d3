"""The compiler worker's HTTP client of the control plane's build routes.

=====================================  ==========================================
``upload_blob(job_id, path, ref)``     ``PUT /v1/builds/{job_id}/blobs/{name}``: the file,
                                       streamed, with the sha256 the worker computed
``complete(job_id, manifest)``         ``POST /v1/builds/{job_id}/complete``: the control
                                       plane re-hashes, signs, records → ``BuildPublished``
=====================================  ==========================================

Authenticated by a worker token (``KILN_WORKER_TOKEN``) scoped to this machine's fingerprint
keys. Error responses are raised as the ``KilnError`` their body names; an unreachable control
plane and retryable statuses (502, 503, ...) as transient errors, which the job retries.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from runtime_agent.errors import ControlPlaneUnreachable, error_from_response
from schemas.builds import BuildCompletion, BuildPublished
from schemas.errors import ConfigError, IntegrityError
from schemas.manifest import ArtifactManifest, BlobRef

logger = logging.getLogger(__name__)

_CHUNK = 1024 * 1024


def _file_chunks(path: Path) -> Iterator[bytes]:
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            yield chunk


class BuildClient:
    """A client of the control plane's worker-facing routes."""

    def __init__(self, api_url: str | None, token: str | None, *,
                 timeout_s: float = 300.0) -> None:
        if not api_url or not token:
            raise ConfigError(
                "a compiler worker publishes through the control plane: set "
                "KILN_WORKER_API_URL (the API's URL) and KILN_WORKER_TOKEN (a worker token "
                "for this machine's fingerprint keys: `kiln token create --role worker --key "
                "KEY`)", api_url=api_url, token_set=bool(token))
        self.api_url = api_url.rstrip("/")
        self.http = httpx.Client(base_url=self.api_url, timeout=timeout_s,
                                 headers={"Authorization": f"Bearer {token}"})

    def close(self) -> None:
        self.http.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise ControlPlaneUnreachable(
                f"cannot reach the control plane at {self.api_url} ({method} {path}): {exc}",
                api_url=self.api_url) from exc
        if response.status_code >= 400:
            raise error_from_response(response, f"{method} {path}")
        return response

    def upload_blob(self, job_id: str, path: Path, ref: BlobRef) -> BlobRef:
        """Stream ``path`` to the control plane as blob ``ref.name`` of ``job_id``; the
        control plane refuses bytes that do not hash to ``ref.sha256``."""
        response = self._call(
            "PUT", f"/v1/builds/{quote(job_id, safe='')}/blobs/{quote(ref.name, safe='')}",
            params={"media_type": ref.media_type},
            headers={"X-Kiln-Sha256": ref.sha256, "Content-Length": str(path.stat().st_size),
                     "Content-Type": "application/octet-stream"},
            content=_file_chunks(path))
        stored = BlobRef.model_validate_json(response.content)
        if stored.sha256 != ref.sha256 or stored.size != ref.size:
            raise IntegrityError(f"blob {ref.name} was stored as {stored.sha256} "
                                 f"({stored.size} bytes); the build made {ref.sha256} "
                                 f"({ref.size} bytes)", blob=ref.name)
        return stored

    def complete(self, job_id: str, manifest: ArtifactManifest, *,
                 replace: bool = False) -> BuildPublished:
        """Ask the control plane to re-hash, sign and record the build."""
        body = BuildCompletion(manifest=manifest.model_copy(update={"signature": None}),
                               replace=replace)
        response = self._call("POST", f"/v1/builds/{quote(job_id, safe='')}/complete",
                              content=body.model_dump_json(),
                              headers={"Content-Type": "application/json"})
        return BuildPublished.model_validate_json(response.content)

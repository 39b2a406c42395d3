"""``/v1/trust``: the root metadata (TUF) that names the online signing key.

Agents are provisioned with the root public key only. They fetch version 1, check it against
that key, then each next version in turn (each signed by the root keys of the version before
it); the latest names the key that signs desired state and manifests now.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Response
from fastapi import Path as PathParam

from services.api.deps import ReaderPrincipal, Route, SettingsDep
from services.signer import root_metadata

router = APIRouter(prefix="/v1/trust", tags=["trust"], route_class=Route)
ROOT = {200: {"content": {"application/json": {}},
              "description": "TUF root metadata, byte for byte as signed"}}


@router.get("/root", response_class=Response, responses=ROOT)
def latest_root(settings: SettingsDep, _: ReaderPrincipal) -> Response:
    """The latest root metadata version."""
    return Response(root_metadata(Path(settings.trust_dir)), media_type="application/json")


@router.get("/root/{version}", response_class=Response, responses=ROOT)
def root_version(
    settings: SettingsDep, _: ReaderPrincipal,
    version: int = PathParam(ge=1, le=10**9),
) -> Response:
    """Root metadata ``version`` (404 past the latest: a client has caught up)."""
    return Response(root_metadata(Path(settings.trust_dir), version),
                    media_type="application/json")

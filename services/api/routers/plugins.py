"""``/v1/plugins``: custom-op plugin bundles, content-addressed and versioned."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, File, Header, Request, Response, UploadFile, status

from schemas.errors import IntegrityError, InvalidRequest
from schemas.manifest import BlobRef
from schemas.plugins import PluginInfo
from services.api.access import check_plugin_access
from services.api.deps import (
    AdminPrincipal,
    ReaderPrincipal,
    Route,
    SessionDep,
    SettingsDep,
    StoreDep,
)
from services.api.gate import BODY_LIMIT
from services.api.inspection import inspect_plugin_bundle
from services.api.threads import committed, run_slow
from services.api.transfers import (
    DOWNLOAD_RESPONSES,
    blob_response,
    received_upload,
    scratch_of,
)
from services.db import repo

router = APIRouter(prefix="/v1/plugins", tags=["plugins"], route_class=Route)
BUNDLE_MEDIA_TYPE = "application/x-tar"


@router.post("", response_model=PluginInfo, status_code=status.HTTP_201_CREATED,
             responses={200: {"description": "the same bundle was registered before"},
                        409: {"description": "that name and version hold another bundle"}},
             openapi_extra={BODY_LIMIT: "max_upload_bytes"})
async def push_plugin(
    response: Response, session: SessionDep, store: StoreDep, settings: SettingsDep,
    _: AdminPrincipal, http: Request,
    file: Annotated[UploadFile, File(description="the bundle archive")],
) -> PluginInfo:
    """Register a bundle built by ``kiln plugin build``. It is validated completely first
    (manifest, confined paths, file digests), in a bounded child; a version is immutable."""
    async with received_upload(file, scratch=scratch_of(http),
                               max_bytes=settings.max_upload_bytes,
                               what="a plugin bundle archive") as (path, _size):
        try:
            manifest = await run_slow(http, inspect_plugin_bundle, path, settings=settings)
        except IntegrityError as exc:  # in an upload, a wrong digest is bad input
            raise InvalidRequest(f"the bundle is inconsistent: {exc.message}",
                                 **exc.details) from exc
        ref = await run_slow(http, store.put_blob, path, name="plugin",
                             media_type=BUNDLE_MEDIA_TYPE)
    info, created = await committed(session, repo.record_plugin, manifest=manifest,
                                    digest=ref.sha256, size_bytes=ref.size)
    if not created:
        response.status_code = status.HTTP_200_OK
    else:  # engines built with an older version of it now have a successor to build
        http.app.state.desired_hub.plugins_changed()
    return info


@router.get("", response_model=list[PluginInfo])
def list_plugins(session: SessionDep, _: ReaderPrincipal) -> list[PluginInfo]:
    return repo.list_plugins(session)


@router.get("/{name}/{version}", response_model=PluginInfo)
def get_plugin(name: str, version: str, session: SessionDep, principal: ReaderPrincipal,
               http: Request) -> PluginInfo:
    check_plugin_access(http, session, principal, name, version)  # an agent: what it runs
    return repo.get_plugin(session, name=name, version=version)


@router.get("/{name}/{version}/bundle", responses=DOWNLOAD_RESPONSES)
def download_bundle(
    name: str, version: str, session: SessionDep, store: StoreDep, settings: SettingsDep,
    principal: ReaderPrincipal, http: Request,
    range_header: str | None = Header(None, alias="Range"),
):
    """The bundle archive (its sha256 is the plugin's digest)."""
    check_plugin_access(http, session, principal, name, version)  # an agent: what it runs
    info = repo.get_plugin(session, name=name, version=version)
    ref = BlobRef(name="plugin", sha256=info.digest, size=info.size_bytes,
                  media_type=BUNDLE_MEDIA_TYPE)
    return blob_response(store, ref, range_header, ttl_s=settings.presign_ttl_s)

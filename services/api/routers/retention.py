"""``/v1/gc``: apply the retention policy now (``kiln gc``), or say what it would delete."""

from __future__ import annotations

from fastapi import APIRouter, Request

from schemas.retention import RetentionReport
from services.api.deps import AdminPrincipal, Route, StoreDep
from services.api.retention import retention_policy, run_retention

router = APIRouter(prefix="/v1/gc", tags=["retention"], route_class=Route)


@router.post("", response_model=RetentionReport)
def collect_garbage(
    _: AdminPrincipal, request: Request, store: StoreDep, dry_run: bool = False
) -> RetentionReport:
    """Delete what the retention policy no longer keeps: artifacts past the newest
    ``KILN_RETENTION_KEEP_PER_KEY`` per (model, fingerprint key) that no deployment or agent
    uses, with their manifests and the blobs nothing else references; finished jobs older
    than ``KILN_JOB_RETENTION_S``; agents silent for ``KILN_AGENT_PRUNE_S``. ``dry_run``
    reports the same without deleting anything."""
    settings = request.app.state.settings
    return run_retention(request.app.state.session_factory, store,
                         retention_policy(settings), dry_run=dry_run)

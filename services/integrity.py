"""Whether a recorded artifact is still whole in the store, shared by the API's and the
workers' cache hits: a lost blob turns the artifact ``broken`` instead of answering a hit on
a dead reference."""

from __future__ import annotations

import logging

from sqlalchemy.orm import Session

from artifact_store.base import ArtifactStore
from services.db import repo

logger = logging.getLogger(__name__)


def usable_artifact(session: Session, store: ArtifactStore, artifact_id: str) -> bool:
    """True when the artifact's manifest and blobs are all in the store (a HEAD or a stat
    each). Otherwise the artifact is marked ``broken`` in ``session`` (the caller commits)
    and its stale manifest is removed from the store, so a rebuild publishes a fresh one and
    no reader sees a manifest whose blobs are gone. A store that does not answer raises
    ``StoreError``: an outage breaks nothing."""
    missing = store.missing_parts(artifact_id)
    if not missing:
        return True
    reason = f"the store {store.uri} lacks {', '.join(missing)}"
    logger.warning("artifact %s is recorded but %s; marking it broken", artifact_id, reason)
    repo.mark_artifact_broken(session, artifact_id=artifact_id, reason=reason)
    store.delete_manifest(artifact_id)
    return False

"""Artifact directories: ``manifest.json`` plus one file per blob (named by ``blob_filename``).

``load_artifact`` is the one way the runtime turns a directory into a running engine: the
manifest is read (and its signature checked when a verifier is given), every blob is
re-hashed against it, and only then does the executor load anything.
"""

from __future__ import annotations

import logging
from pathlib import Path

from artifact_store.digest import sha256_file
from artifact_store.signing import Verifier, manifest_from_bytes
from runtime_agent.executors import MANIFEST_FILENAME, Executor, blob_filename, load_executor
from schemas.errors import IntegrityError, InvalidRequest, KilnError
from schemas.manifest import ArtifactManifest

logger = logging.getLogger(__name__)


def manifest_bytes(directory: Path) -> bytes:
    """The stored manifest of the artifact directory (what its signature covers)."""
    path = Path(directory) / MANIFEST_FILENAME
    try:
        return path.read_bytes()
    except OSError as exc:
        raise InvalidRequest(
            f"{directory} is not an artifact directory: cannot read {path} "
            f"({exc.strerror or exc})", path=str(path),
        ) from exc


def read_manifest(directory: Path, verifier: Verifier | None = None) -> ArtifactManifest:
    """The manifest of the artifact directory, its signature checked over the stored bytes
    when a ``verifier`` is given; ``InvalidRequest`` when missing or not a manifest."""
    data = manifest_bytes(directory)
    if verifier is not None:
        return verifier.verify_manifest(data)
    path = Path(directory) / MANIFEST_FILENAME
    try:
        return manifest_from_bytes(data, what=str(path))
    except KilnError as exc:
        raise InvalidRequest(exc.message, path=str(path)) from exc


def verify_blobs(directory: Path, manifest: ArtifactManifest) -> None:
    """Re-hash every blob the manifest lists; ``IntegrityError`` on the first that differs."""
    for ref in manifest.blobs:
        path = Path(directory) / blob_filename(ref)
        try:
            digest, size = sha256_file(path)
        except OSError as exc:
            raise IntegrityError(
                f"artifact {manifest.artifact_id}: blob {ref.name!r} cannot be read at {path} "
                f"({exc.strerror or exc})", artifact_id=manifest.artifact_id, blob=ref.name,
            ) from exc
        if size != ref.size or digest != ref.sha256:
            raise IntegrityError(
                f"artifact {manifest.artifact_id}: blob {ref.name!r} at {path} has {size} bytes "
                f"and sha256 {digest}; the manifest lists {ref.size} bytes and sha256 "
                f"{ref.sha256}", artifact_id=manifest.artifact_id, blob=ref.name,
            )


def load_artifact(directory: Path, verifier: Verifier | None = None) -> Executor:
    """Check the artifact in ``directory`` (signature when ``verifier`` is given, then every
    blob's sha256) and load it with the executor of its backend."""
    manifest = read_manifest(directory, verifier)
    verify_blobs(directory, manifest)
    logger.debug("artifact %s in %s verified; loading", manifest.artifact_id, directory)
    return load_executor(Path(directory), manifest)

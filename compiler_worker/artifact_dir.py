"""A compile's result and the artifact directory written from it: ``manifest.json``, the
blobs named by ``blob_filename`` and the plugin bundles the engine needs, each checked against
the manifest as it is copied, the directory appearing atomically."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from artifact_store.digest import sha256_file
from runtime_agent.executors import MANIFEST_FILENAME, blob_filename
from schemas.errors import Conflict, IntegrityError, InvalidRequest
from schemas.manifest import ArtifactManifest

__all__ = ["PLUGINS_DIRNAME", "CompileResult", "fresh_dir", "write_artifact_dir"]

logger = logging.getLogger(__name__)

#: Where an artifact directory keeps the plugin bundles its engine needs:
#: ``plugins/<digest>.tar``.
PLUGINS_DIRNAME = "plugins"


@dataclass
class CompileResult:
    """A verified engine: its unsigned manifest and where its blobs are (inside ``workdir``)."""

    manifest: ArtifactManifest
    blob_paths: dict[str, Path]
    #: Bundle archive of every plugin in ``manifest.plugins``, by digest (the caller's files).
    plugin_paths: dict[str, Path] = field(default_factory=dict)


def fresh_dir(path: Path) -> Path:
    """``path`` as an empty directory (whatever an earlier attempt left there is removed)."""
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def _copy_checked(source: Path, destination: Path, sha256: str, size: int | None = None, *,
                  what: str) -> None:
    """Copy ``source``; ``IntegrityError`` unless the copy has this sha256 (and size)."""
    shutil.copyfile(source, destination)
    got_size, digest = destination.stat().st_size, sha256_file(destination)[0]
    if digest != sha256 or (size is not None and got_size != size):
        expected = f"{size} bytes and sha256 {sha256}" if size is not None else f"sha256 {sha256}"
        raise IntegrityError(f"{what} has {got_size} bytes and sha256 {digest}; the manifest "
                             f"lists {expected}")


def write_artifact_dir(
    result: CompileResult, out_dir: Path, manifest: ArtifactManifest | bytes | None = None
) -> Path:
    """Write ``manifest.json`` and the blobs (named by ``blob_filename``) to ``out_dir``.

    ``manifest`` defaults to ``result.manifest`` (unsigned); pass the signed envelope
    (``Signer.sign_manifest``) to write those bytes as they are. Every blob
    is checked against the manifest's size and sha256 as it is copied; so is every plugin
    bundle the manifest names, copied to ``plugins/<digest>.tar`` (where ``kiln.runtime.load``
    finds them). The directory appears atomically: it is built in a temporary sibling, then
    renamed. An existing ``out_dir`` is refused (``Conflict``).
    """
    manifest = manifest if manifest is not None else result.manifest
    if isinstance(manifest, bytes):
        # Imported here: the signing stack (securesystemslib, which loads boto3) is only for
        # a stored manifest, and every sandboxed build child imports this module.
        from artifact_store.signing import manifest_from_bytes

        stored, manifest = manifest, manifest_from_bytes(manifest)
    else:
        stored = manifest.model_dump_json(indent=2).encode() + b"\n"
    if manifest.artifact_id != result.manifest.artifact_id:
        raise InvalidRequest(
            f"the manifest is for artifact {manifest.artifact_id}, the result for "
            f"{result.manifest.artifact_id}"
        )
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise Conflict(f"{out_dir} already exists; choose a new directory for the artifact")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    try:
        for ref in manifest.blobs:
            source = result.blob_paths.get(ref.name)
            if source is None:
                raise IntegrityError(
                    f"the manifest lists blob {ref.name!r}; the result has "
                    f"{sorted(result.blob_paths)}"
                )
            _copy_checked(source, staging / blob_filename(ref), ref.sha256, ref.size,
                          what=f"blob {ref.name!r} ({source})")
        for plugin in manifest.plugins:
            source = result.plugin_paths.get(plugin.digest)
            if source is None:
                raise IntegrityError(
                    f"the manifest names plugin {plugin.name} {plugin.version} "
                    f"({plugin.digest}); the result has no bundle for it"
                )
            (staging / PLUGINS_DIRNAME).mkdir(exist_ok=True)
            _copy_checked(source, staging / PLUGINS_DIRNAME / f"{plugin.digest}.tar",
                          plugin.digest, what=f"plugin bundle {source} "
                                              f"({plugin.name} {plugin.version})")
        (staging / MANIFEST_FILENAME).write_bytes(stored)
        staging.chmod(0o755)
        os.rename(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("wrote artifact %s to %s", manifest.artifact_id, out_dir)
    return out_dir

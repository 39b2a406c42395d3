"""Inspecting uploads in a bounded child (``artifact_store.sandbox``), never in the API
process: the model's structure and graph, a dataset's ``.npz`` headers, a plugin bundle.

The API process only streams the upload to a temporary file; a child with no credentials, the
upload readable and a scratch folder writable parses it, writes the canonical model blob into
the scratch folder and answers what the API records. A parser that allocates beyond
``KILN_INSPECT_MEMORY_BYTES`` or runs past ``KILN_INSPECT_CPU_S`` / ``KILN_INSPECT_TIMEOUT_S``
fails the upload with ``resource_limit`` (413) or ``timed_out`` (422); the API serves on.

This is the parent's side only: ``check_model_upload``, ``inspect_dataset`` and
``inspect_plugin_bundle`` run a step of the child entry point ``artifact_store.inspection``
(``python -m artifact_store.inspection``), which holds the parsing. The API names that module
by a string and never imports it, so no parser is imported into the process that holds
credentials (an import-linter contract forbids it).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from artifact_store.sandbox import Limits, run_sandboxed
from schemas.errors import ErrorCode, KilnError, SandboxCrashed
from schemas.manifest import TensorSpec
from schemas.models import ModelCheck
from schemas.plugins import PluginManifest
from services.config import KilnSettings

__all__ = [
    "INSPECTION_CHILD",
    "ModelCheck",
    "check_model_upload",
    "inspect_dataset",
    "inspect_plugin_bundle",
    "inspection_limits",
]

#: The child entry point (``python -m <it>``) whose steps parse an upload. A plain string on
#: purpose: importing that module here would load the parsers into the API process.
INSPECTION_CHILD = "artifact_store.inspection"
#: Open files an inspection child may hold.
INSPECT_OPEN_FILES = 256
#: Room for the canonical archive's headers beyond the upload itself.
_ARCHIVE_SLACK_BYTES = 64 << 20


def inspection_limits(settings: KilnSettings) -> Limits:
    return Limits(
        address_space_bytes=settings.inspect_memory_bytes,
        cpu_s=settings.inspect_cpu_s,
        file_size_bytes=settings.max_upload_bytes + _ARCHIVE_SLACK_BYTES,
        open_files=INSPECT_OPEN_FILES,
        wall_s=settings.inspect_timeout_s,
        landlock=settings.sandbox_landlock,
        network_isolation=settings.sandbox_network_isolation,
        fork_server=settings.sandbox_fork_server,
    )


def _inspect(step: str, args: dict[str, Any], *, scratch: Path, settings: KilnSettings,
             stage: str, readable: list[Path]) -> Any:
    """Run ``step`` of ``artifact_store.inspection.STEPS`` in an inspection child. An
    unexpected failure in it is the upload's doing (a parser tripping over it), answered 422
    ``sandbox_crashed``, never a 500 of the API."""
    try:
        return run_sandboxed(INSPECTION_CHILD, step, args, scratch=scratch,
                             limits=inspection_limits(settings), stage=stage, readable=readable)
    except KilnError as exc:
        if exc.code is not ErrorCode.INTERNAL:
            raise
        raise SandboxCrashed(f"inspecting the upload failed: {exc.message}",
                             **exc.details) from exc


def _answer(answer: Any, build, what: str):
    try:
        return build(answer)
    except (TypeError, ValueError, KeyError) as exc:
        raise SandboxCrashed(f"the {what} inspection answered something unreadable: "
                             f"{exc}") from exc


def check_model_upload(received: list[tuple[str | None, Path]], dest: Path, *,
                       settings: KilnSettings) -> ModelCheck:
    """``artifact_store.inspection.check_upload`` in a child: the received files readable,
    ``dest``'s folder its scratch (where the blob is written)."""
    dest = Path(dest)
    answer = _inspect(
        "model",
        {"received": [[name, str(Path(path).resolve())] for name, path in received],
         "dest": dest.name, "max_bytes": settings.max_upload_bytes},
        scratch=dest.parent, settings=settings, stage="inspect_model",
        readable=[Path(path) for _, path in received])

    checked = _answer(answer, ModelCheck.model_validate, "model")
    if dest.is_symlink() or not dest.is_file():
        raise SandboxCrashed("the model inspection wrote no model blob", stage="inspect_model")
    return checked


def inspect_dataset(path: Path, *, settings: KilnSettings, max_bytes: int) -> list[TensorSpec]:
    """``schemas.datasets.inspect_npz`` in a child."""
    # Beside the upload: in the serving process's folder for an upload's files, which the
    # next API to start removes if this one is killed (services.api.transfers.ScratchFolder).
    with tempfile.TemporaryDirectory(prefix="kiln-inspect-", dir=Path(path).parent) as scratch:
        answer = _inspect(
            "dataset", {"path": str(Path(path).resolve()), "max_bytes": max_bytes},
            scratch=Path(scratch), settings=settings, stage="inspect_dataset",
            readable=[Path(path)])
    return _answer(answer, lambda raw: [TensorSpec.model_validate(t) for t in raw], "dataset")


def inspect_plugin_bundle(path: Path, *, settings: KilnSettings) -> PluginManifest:
    """``artifact_store.bundles.read_bundle`` in a child: the bundle's manifest."""
    # Beside the upload: in the serving process's folder for an upload's files, which the
    # next API to start removes if this one is killed (services.api.transfers.ScratchFolder).
    with tempfile.TemporaryDirectory(prefix="kiln-inspect-", dir=Path(path).parent) as scratch:
        answer = _inspect(
            "bundle", {"path": str(Path(path).resolve())},
            scratch=Path(scratch), settings=settings, stage="inspect_plugin",
            readable=[Path(path)])
    return _answer(answer, PluginManifest.model_validate, "plugin bundle")

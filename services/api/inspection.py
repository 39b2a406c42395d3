"""Inspecting uploads in a bounded child (``artifact_store.sandbox``), never in the API
process: the model's structure and graph, a dataset's ``.npz`` headers, a plugin bundle.

The API process only streams the upload to a temporary file; a child with no credentials, the
upload readable and a scratch folder writable parses it, writes the canonical model blob into
the scratch folder and answers what the API records. A parser that allocates beyond
``KILN_INSPECT_MEMORY_BYTES`` or runs past ``KILN_INSPECT_CPU_S`` / ``KILN_INSPECT_TIMEOUT_S``
fails the upload with ``resource_limit`` (413) or ``timed_out`` (422); the API serves on.

The child's side is the ``*_child`` functions and the plain checks they call, served by this
module's ``__main__`` (the child runs ``python -m services.api.inspection``, its steps the
fixed table ``STEPS``); the parent's side is ``check_model_upload``, ``inspect_dataset`` and
``inspect_plugin_bundle``. What this module imports at its top is imported in the child
before it confines itself: pydantic models and settings only; the parsers load inside the
steps, after.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from artifact_store.sandbox import Emit, Limits, Step, run_sandboxed, serve_child
from schemas.errors import ErrorCode, InvalidModel, KilnError, SandboxCrashed
from schemas.manifest import TensorSpec
from schemas.plugins import PluginManifest
from services.config import KilnSettings

if TYPE_CHECKING:
    import onnx

__all__ = [
    "ModelCheck",
    "canonical_upload",
    "check_model_upload",
    "check_upload",
    "inspect_dataset",
    "inspect_plugin_bundle",
    "inspection_limits",
]

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
    )


@dataclass(frozen=True)
class ModelCheck:
    """An uploaded model, checked: its blob's media type, format and what the API reports."""

    media_type: str
    format: str
    opset: int
    ir_version: int
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]


def _inspect(step: str, args: dict[str, Any], *, scratch: Path, settings: KilnSettings,
             stage: str, readable: list[Path]) -> Any:
    """Run ``step`` of ``STEPS`` in an inspection child. An unexpected failure in it is the
    upload's doing (a parser tripping over it), answered 422 ``sandbox_crashed``, never a
    500 of the API."""
    try:
        return run_sandboxed(__name__, step, args, scratch=scratch,
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
    """``check_upload`` in a child: the received files readable, ``dest``'s folder its
    scratch (where the blob is written)."""
    dest = Path(dest)
    answer = _inspect(
        "model",
        {"received": [[name, str(Path(path).resolve())] for name, path in received],
         "dest": dest.name, "max_bytes": settings.max_upload_bytes},
        scratch=dest.parent, settings=settings, stage="inspect_model",
        readable=[Path(path) for _, path in received])

    def build(raw: dict[str, Any]) -> ModelCheck:
        return ModelCheck(
            media_type=str(raw["media_type"]), format=str(raw["format"]),
            opset=int(raw["opset"]), ir_version=int(raw["ir_version"]),
            inputs=[TensorSpec.model_validate(t) for t in raw["inputs"]],
            outputs=[TensorSpec.model_validate(t) for t in raw["outputs"]])

    checked = _answer(answer, build, "model")
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


# --- in the child ------------------------------------------------------------------------------

def _preload() -> None:
    """Import the parsers before reading the upload, so that an upload which exhausts the
    address space fails in the parser (``resource_limit``), never halfway through an import."""
    import numpy  # noqa: F401
    import onnx  # noqa: F401

    import schemas.onnx_model
    import schemas.torch_export  # noqa: F401


def model_child(args: dict[str, Any], emit: Emit) -> dict[str, Any]:
    _preload()
    received = [(name, Path(path)) for name, path in args["received"]]
    checked = check_upload(received, Path(args["dest"]), max_bytes=args["max_bytes"])
    return {**asdict(checked), "inputs": [t.model_dump(mode="json") for t in checked.inputs],
            "outputs": [t.model_dump(mode="json") for t in checked.outputs]}


def dataset_child(args: dict[str, Any], emit: Emit) -> list[dict[str, Any]]:
    from schemas.datasets import inspect_npz

    _preload()
    specs = inspect_npz(Path(args["path"]).read_bytes(), max_bytes=args["max_bytes"])
    return [spec.model_dump(mode="json") for spec in specs]


def bundle_child(args: dict[str, Any], emit: Emit) -> dict[str, Any]:
    from artifact_store.bundles import read_bundle

    return read_bundle(Path(args["path"])).model_dump(mode="json")


def canonical_upload(received: list[tuple[str | None, Path]], dest: Path, *,
                     max_bytes: int) -> tuple[onnx.ModelProto, str]:
    """The canonical model blob for the uploaded files, written to ``dest``: (the model's
    graph, external tensors not loaded; the blob's media type).

    One file: a self-contained ``.onnx``, or a tar archive (detected by its content) of the
    ``.onnx`` and its external data. Several files: the ``.onnx`` and each data file it
    references, named by its location. Either way only the graph is parsed; the weights are
    checked (present, inside the archive, offsets in range) and streamed, never loaded.
    Bad input raises ``InvalidModel`` / ``ModelTooLarge``.
    """
    from artifact_store.model_archive import canonical_model_blob, pack_model_files

    if len(received) == 1:
        return canonical_model_blob(received[0][1], dest, max_bytes=max_bytes)
    names = [filename for filename, _ in received]
    if any(not filename for filename in names):
        raise InvalidModel(f"a multipart model upload names every file (the .onnx, and each "
                           f"data file by the location the model gives it); got {names}")
    models = [filename for filename in names if filename and filename.endswith(".onnx")]
    if len(models) != 1:
        raise InvalidModel(f"a multipart model upload holds exactly one .onnx file and its "
                           f"data files; got {names}", files=names)
    model_path = next(path for filename, path in received if filename == models[0])
    data = {filename: path for filename, path in received if filename and filename != models[0]}
    return pack_model_files(model_path, data, dest, max_bytes=max_bytes)


def _is_zip_file(path: Path) -> bool:
    from schemas.torch_export import is_zip

    with path.open("rb") as handle:
        return is_zip(handle.read(4))


def check_upload(received: list[tuple[str | None, Path]], dest: Path, *,
                 max_bytes: int) -> ModelCheck:
    """Check the uploaded files and write the model blob to ``dest``: a ``torch.export``
    archive (one zip file) is checked for structure only and stored as it is; ONNX goes
    through ``canonical_upload``."""
    from schemas.onnx_model import default_opset, signature
    from schemas.torch_export import (
        TORCH_EXPORT_FORMAT,
        TORCH_EXPORT_MEDIA_TYPE,
        inspect_export_archive,
    )

    zips = [path for _, path in received if _is_zip_file(path)]
    if len(received) == 1 and zips:
        info = inspect_export_archive(zips[0], max_bytes=max_bytes)
        shutil.copyfile(zips[0], dest)
        return ModelCheck(TORCH_EXPORT_MEDIA_TYPE, TORCH_EXPORT_FORMAT, info.aten_opset,
                         info.schema_major, info.inputs, info.outputs)
    if zips:
        raise InvalidModel("a torch.export archive (.pt2) is uploaded alone, as one file")
    graph, media_type = canonical_upload(received, dest, max_bytes=max_bytes)
    inputs, outputs = signature(graph)
    return ModelCheck(media_type, "onnx", default_opset(graph), int(graph.ir_version),
                     inputs, outputs)


#: The steps an inspection child offers (``python -m services.api.inspection``), by name.
STEPS: dict[str, Step] = {"model": model_child, "dataset": dataset_child,
                          "bundle": bundle_child}

if __name__ == "__main__":
    serve_child(STEPS)

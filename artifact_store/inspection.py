"""The inspection child's side: parsing an upload (a model, a dataset's ``.npz`` headers, a
plugin bundle) in a bounded child that the API starts (``services.api.inspection``), never in
the API process.

This module runs only as that child (``python -m artifact_store.inspection``): its
``__main__`` hands the fixed table ``STEPS`` to ``artifact_store.sandbox.serve_child``. It
lives below the control plane so that ``services`` imports no parser at all; the API names
it by a string and never imports it. Each step gets what it needs in its args (the upload's
paths, the size limit), never the API's settings. What this module imports at its top is
imported before the child confines itself: the sandbox's loop and pydantic models only; the
parsers load inside the steps, after.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from artifact_store.sandbox import Emit, Step, serve_child
from schemas.errors import InvalidModel
from schemas.models import ModelCheck

if TYPE_CHECKING:
    import onnx

__all__ = ["STEPS", "canonical_upload", "check_upload"]


def _preload() -> None:
    """Import the parsers before reading the upload, so that an upload which exhausts the
    address space fails in the parser (``resource_limit``), never halfway through an import.
    The fork server imports them once for all children (``serve_child``'s ``preload``)."""
    import numpy  # noqa: F401
    import onnx  # noqa: F401

    import schemas.onnx_model
    import schemas.torch_export  # noqa: F401


def model_child(args: dict[str, Any], emit: Emit) -> dict[str, Any]:
    _preload()
    received = [(name, Path(path)) for name, path in args["received"]]
    checked = check_upload(received, Path(args["dest"]), max_bytes=args["max_bytes"])
    return checked.model_dump(mode="json")


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
        return ModelCheck(media_type=TORCH_EXPORT_MEDIA_TYPE, format=TORCH_EXPORT_FORMAT,
                          opset=info.aten_opset, ir_version=info.schema_major,
                          inputs=info.inputs, outputs=info.outputs)
    if zips:
        raise InvalidModel("a torch.export archive (.pt2) is uploaded alone, as one file")
    graph, media_type = canonical_upload(received, dest, max_bytes=max_bytes)
    inputs, outputs = signature(graph)
    return ModelCheck(media_type=media_type, format="onnx", opset=default_opset(graph),
                      ir_version=int(graph.ir_version), inputs=inputs, outputs=outputs)


#: The steps an inspection child offers (``python -m artifact_store.inspection``), by name.
STEPS: dict[str, Step] = {"model": model_child, "dataset": dataset_child,
                          "bundle": bundle_child}

if __name__ == "__main__":
    serve_child(STEPS, preload=_preload)

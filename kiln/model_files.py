"""The files a model on disk consists of: the ``.onnx`` and the external data it references,
or one ``torch.export`` archive (``.pt2``).

``torch.onnx.export`` writes ``model.onnx`` and ``model.onnx.data`` by default; ``kiln submit``
and ``kiln compile`` take the ``.onnx`` and find its data files beside it here. A ``.pt2``
(``torch.export.save``, a zip, recognized by its content) is uploaded alone, as it is.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from schemas.errors import InvalidModel
from schemas.onnx_model import external_refs, parse_model


def data_files_beside(model_path: Path) -> dict[str, Path]:
    """The external data files the ``.onnx`` at ``model_path`` references: location -> path
    beside it (only the graph is read, not the weights). ``InvalidModel`` for a location that
    escapes the model's directory (``..``, an absolute path, a symbolic link) or a missing file.
    """
    model_path = Path(model_path)
    model = parse_model(model_path.read_bytes())
    root = model_path.parent.resolve()
    files: dict[str, Path] = {}
    for ref in external_refs(model):
        path = root / ref.path
        if path.is_symlink() or (path.exists() and root not in path.resolve().parents):
            raise InvalidModel(f"external data {ref.path!r} of {model_path.name} resolves "
                               f"outside its directory {root}", path=ref.path)
        if not path.is_file():
            raise InvalidModel(f"{model_path.name} keeps tensors in {ref.path!r}, which is not "
                               f"beside it ({path} does not exist)", missing_files=[ref.path])
        files[ref.path] = path
    return files


def model_files(model_path: Path) -> dict[str, Path]:
    """What to upload for the model at ``model_path``: upload name -> path. A model archive
    (tar) or a ``torch.export`` archive alone; a ``.onnx`` first, under its own name, then its
    data files by location."""
    from schemas.onnx_model import is_tar
    from schemas.torch_export import is_zip

    model_path = Path(model_path)
    with model_path.open("rb") as handle:
        head = handle.read(512)
    if is_tar(head) or is_zip(head):
        return {model_path.name: model_path}
    data = data_files_beside(model_path)
    name = model_path.name if model_path.name.endswith(".onnx") else f"{model_path.name}.onnx"
    if name in data:
        raise InvalidModel(f"{model_path.name} keeps tensors in a file of its own name")
    return {name: model_path, **data}


def model_blob(model_path: Path, dest: Path) -> Path:
    """Write the canonical model blob for the model at ``model_path`` (a ``.onnx`` with its
    data files beside it, a model archive, or a ``torch.export`` archive) to ``dest``: the
    bytes the API would store, so ``kiln compile`` and the compile farm see the same model
    id."""
    from artifact_store.model_archive import canonical_model_blob, pack_model_files
    from schemas.torch_export import inspect_export_archive, is_zip

    files = model_files(model_path)
    with Path(model_path).open("rb") as handle:
        if is_zip(handle.read(4)):
            inspect_export_archive(Path(model_path))  # what the API would refuse, refused here
            shutil.copyfile(model_path, dest)
            return dest
    if len(files) == 1:
        canonical_model_blob(Path(model_path), dest)
    else:
        pack_model_files(Path(model_path), dict(list(files.items())[1:]), dest)
    return dest

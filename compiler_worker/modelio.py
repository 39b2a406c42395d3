"""Reading submitted models and writing the prepared one.

The definitions of what a model blob is live in ``schemas.onnx_model`` (shared with the API);
packing and confined unpacking of model archives in ``artifact_store.model_archive``. Here:
turning a blob into files a backend builds from (``materialize_model``), loading them with
their external data, and saving a model with external data when it is large.
"""

from __future__ import annotations

import logging
from pathlib import Path

import onnx

from artifact_store.model_archive import pack_model_files, unpack_model_archive
from schemas.errors import InvalidModel
from schemas.onnx_model import (
    ARCHIVE_MODEL_NAME,
    UNKNOWN_DIM,
    UNKNOWN_RANK,
    default_opset,
    is_tar,
    load_model_bytes,
    signature,
)

__all__ = [
    "EXTERNAL_DATA_THRESHOLD",
    "UNKNOWN_DIM",
    "UNKNOWN_RANK",
    "default_opset",
    "is_tar",
    "load_model",
    "load_model_bytes",
    "materialize_model",
    "pack_model_files",
    "save_model",
    "signature",
]

logger = logging.getLogger(__name__)

#: A model whose tensors exceed this is saved with external data (protobuf stops at 2 GiB).
EXTERNAL_DATA_THRESHOLD = 1_500_000_000


def materialize_model(blob: bytes, dest: Path) -> Path:
    """Write a model blob (a self-contained ``.onnx`` or a model archive) into the directory
    ``dest`` and return the path of the ``.onnx`` to build from, its data files beside it.

    An archive is unpacked confined to ``dest`` (``unpack_model_archive``); a plain ``.onnx``
    that references external data raises ``InvalidModel`` naming the missing files.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    if is_tar(blob):
        import io

        return unpack_model_archive(io.BytesIO(blob), dest)
    load_model_bytes(blob)  # refuses a model whose data was not submitted with it
    path = dest / ARCHIVE_MODEL_NAME
    path.write_bytes(blob)
    return path


def load_model(path: Path, *, load_external_data: bool = True) -> onnx.ModelProto:
    """Load ``path`` with its external data (the files beside it), or only its graph."""
    try:
        return onnx.load(str(path), load_external_data=load_external_data)
    except Exception as exc:  # onnx raises untyped errors for unreadable data files
        raise InvalidModel(f"cannot load the model {Path(path).name} with its external "
                           f"data: {exc}") from exc


def save_model(model: onnx.ModelProto, path: Path, *, external: bool = False) -> Path:
    """Save ``model`` to ``path``; with its tensors in ``<name>.data`` beside it when
    ``external`` or when the model exceeds ``EXTERNAL_DATA_THRESHOLD`` (protobuf cannot
    serialize 2 GiB). Returns ``path``.

    The pipeline saves the prepared model by size alone: a small model is built from one
    self-contained file even when it was submitted with external data (the backends then
    write self-contained engines)."""
    path = Path(path)
    size = model.ByteSize()
    if external or size > EXTERNAL_DATA_THRESHOLD:
        data = path.with_name(path.name + ".data")
        data.unlink(missing_ok=True)  # onnx appends to an existing data file
        onnx.save_model(model, str(path), save_as_external_data=True,
                        all_tensors_to_one_file=True, location=data.name,
                        size_threshold=1024)
        logger.info("saved %s (%d bytes) with its tensors in %s", path.name, size, data.name)
    else:
        onnx.save_model(model, str(path))
    return path

"""Models saved the way ``torch.onnx.export`` saves them: ``.onnx`` + external data files,
and hand-made model archives, hostile ones included."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import onnx

from kiln.examples import small_cnn


def save_external(model: onnx.ModelProto, directory: Path, name: str = "model.onnx",
                  location: str | None = None) -> Path:
    """Save ``model`` in ``directory`` with every tensor in one external data file
    (``<name>.data`` unless ``location``); returns the ``.onnx`` path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=location or f"{name}.data", size_threshold=0)
    return path


def external_cnn(directory: Path, *, seed: int = 0) -> Path:
    """``kiln.examples.small_cnn`` saved with external data in ``directory``."""
    return save_external(small_cnn(seed=seed), directory)


def tar_bytes(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    """A tar of hand-made members (``None`` data for links and directories)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    return out.getvalue()


def regular(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), data


def symlink(name: str, target: str) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = tarfile.SYMTYPE
    info.linkname = target
    return info, None


def with_location(model_path: Path, location: str, *, offset: int | None = None,
                  length: int | None = None) -> bytes:
    """The bytes of the ``.onnx`` at ``model_path`` with every external tensor pointed at
    ``location`` (and ``offset``/``length`` when given)."""
    model = onnx.load(str(model_path), load_external_data=False)
    for tensor in model.graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        entries = {e.key: e.value for e in tensor.external_data}
        entries["location"] = location
        if offset is not None:
            entries["offset"] = str(offset)
        if length is not None:
            entries["length"] = str(length)
        del tensor.external_data[:]
        for key, value in entries.items():
            tensor.external_data.add(key=key, value=value)
    return model.SerializeToString()

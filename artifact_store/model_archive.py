"""Model archives: an ONNX model and its external data files as one deterministic tar.

A model blob is a self-contained ``.onnx`` or a canonical archive (the rules every archive
must meet live in ``schemas.onnx_model``). The canonical archive is uncompressed, holds the
model as ``model.onnx`` and exactly the data files its tensors reference (under their
locations), members sorted by name, zero mtimes, owners and group, mode 0644. Its sha256 is
the model id, so the same model and data always give the same id, however they were uploaded
(one archive, several files, the CLI); a model that references no external data is stored as
its plain ``.onnx`` bytes, exactly as before archives existed.

Everything here streams: weights are copied file to file, never held in memory; only the
``.onnx`` itself (the graph) is read whole.
"""

from __future__ import annotations

import logging
import os
import shutil
import tarfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import IO, TYPE_CHECKING

from schemas.errors import InvalidModel
from schemas.onnx_model import (
    ARCHIVE_MODEL_NAME,
    MODEL_ARCHIVE_MEDIA_TYPE,
    ONNX_MEDIA_TYPE,
    archive_members,
    archive_model_member,
    archive_sizes,
    check_external_refs,
    confined_path,
    external_refs,
    is_tar,
    parse_model,
)

if TYPE_CHECKING:
    import onnx

__all__ = [
    "NO_LIMIT",
    "canonical_model_blob",
    "is_model_archive",
    "pack_model_files",
    "unpack_model_archive",
]

logger = logging.getLogger(__name__)

#: ``max_bytes`` meaning "no limit beyond the disk's".
NO_LIMIT = 1 << 62
_CHUNK = 1 << 20

Opener = Callable[[], IO[bytes]]


def is_model_archive(path: Path) -> bool:
    """Whether the file at ``path`` is a tar archive (by its header, not its name)."""
    with path.open("rb") as handle:
        return is_tar(handle.read(512))


def _info(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info


def _write(model_bytes: bytes, files: Mapping[str, tuple[int, Opener]], dest: Path,
           what: str) -> tuple[onnx.ModelProto, str]:
    """Check the model against ``files`` (path -> (size, opener)) and write the canonical blob
    to ``dest``: (the model's graph, the blob's media type)."""
    model = parse_model(model_bytes)
    refs = external_refs(model)
    check_external_refs(refs, {name: size for name, (size, _) in files.items()})
    if not refs:
        if files:
            logger.info("%s: the model references no external data; %s not stored", what,
                        sorted(files))
        dest.write_bytes(model_bytes)
        return model, ONNX_MEDIA_TYPE
    needed = sorted({ref.path for ref in refs})
    if ARCHIVE_MODEL_NAME in needed:
        raise InvalidModel(f"the model keeps tensors in a file named {ARCHIVE_MODEL_NAME!r}, "
                           f"the name Kiln gives the model itself; rename the data file")
    unused = sorted(set(files) - set(needed))
    if unused:
        logger.info("%s: files %s are not referenced by the model; not stored", what, unused)
    import io

    with dest.open("wb") as out, tarfile.open(fileobj=out, mode="w",
                                              format=tarfile.PAX_FORMAT) as tar:
        for name in sorted([ARCHIVE_MODEL_NAME, *needed]):
            if name == ARCHIVE_MODEL_NAME:
                tar.addfile(_info(name, len(model_bytes)), io.BytesIO(model_bytes))
                continue
            size, opener = files[name]
            with opener() as source:
                try:
                    tar.addfile(_info(name, size), source)
                except (OSError, tarfile.TarError) as exc:  # it ended before its size
                    raise InvalidModel(f"data file {name!r} is shorter than its "
                                       f"{size} declared bytes") from exc
    return model, MODEL_ARCHIVE_MEDIA_TYPE


def pack_model_files(model: Path | bytes, files: Mapping[str, Path], dest: Path, *,
                     max_bytes: int = NO_LIMIT) -> tuple[onnx.ModelProto, str]:
    """Write the canonical blob for a ``.onnx`` (path or bytes) and its data ``files``
    (location -> path on disk) to ``dest``.

    Returns (the model's graph, its external tensors not loaded; the blob's media type:
    ``application/x-onnx`` when the model references no external data, else
    ``application/x-tar``). ``InvalidModel`` names the referenced files that are missing, a
    location escaping the model's directory, a tensor outside its file; ``ModelTooLarge``
    when the files exceed ``max_bytes``.
    """
    from schemas.errors import ModelTooLarge

    model_bytes = model.read_bytes() if isinstance(model, Path) else model
    entries: dict[str, tuple[int, Opener]] = {}
    total = len(model_bytes)
    for location, path in files.items():
        name = confined_path(location, what="data file")
        if name in entries:
            raise InvalidModel(f"data file {name!r} is given twice", path=name)
        size = Path(path).stat().st_size
        total += size
        if total > max_bytes:
            raise ModelTooLarge(f"the model and its data files are over {max_bytes} bytes, the "
                                f"limit", limit_bytes=max_bytes)
        entries[name] = (size, partial(Path(path).open, "rb"))
    return _write(model_bytes, entries, dest, what="model files")


def canonical_model_blob(source: Path, dest: Path, *,
                         max_bytes: int = NO_LIMIT) -> tuple[onnx.ModelProto, str]:
    """The canonical blob for an uploaded file, written to ``dest``: a plain ``.onnx`` is
    checked (a self-contained model is stored as it is; one referencing external data is
    refused naming the missing files), a tar archive is checked member by member
    (``schemas.onnx_model.archive_model_member``) and repacked canonically.
    Returns what ``pack_model_files`` returns."""
    if not is_model_archive(source):
        return _write(source.read_bytes(), {}, dest, what=str(source.name))
    with _open_tar(source) as tar:
        members = archive_members(tar)
        model_member = archive_model_member(members, max_bytes=max_bytes)
        by_name = {confined_path(m.name, what="archive member"): m for m in members}
        entries: dict[str, tuple[int, Opener]] = {}
        for name, size in archive_sizes(members).items():
            if by_name[name] is not model_member:
                entries[name] = (size, lambda member=by_name[name]: _open_member(tar, member))
        with _open_member(tar, model_member) as handle:
            model_bytes = handle.read()
        return _write(model_bytes, entries, dest, what="model archive")


@contextmanager
def _open_tar(source: Path | IO[bytes]) -> Iterator[tarfile.TarFile]:
    try:
        tar = (tarfile.open(source, mode="r:") if isinstance(source, Path)  # noqa: SIM115
               else tarfile.open(fileobj=source, mode="r:"))  # noqa: SIM115
    except tarfile.TarError as exc:
        raise InvalidModel(f"the model blob is not a readable tar archive: {exc}") from exc
    with tar:
        yield tar


def _open_member(tar: tarfile.TarFile, member: tarfile.TarInfo) -> IO[bytes]:
    handle = tar.extractfile(member)
    if handle is None:  # pragma: no cover: only regular members reach here
        raise InvalidModel(f"archive member {member.name!r} has no data")
    return handle


def unpack_model_archive(source: Path | IO[bytes], dest: Path, *,
                         max_bytes: int = NO_LIMIT) -> Path:
    """Unpack a model archive into the directory ``dest`` (created; must not hold the files)
    and return the path of its ``.onnx``, its data files beside it.

    Confined: the members are checked before anything is written (regular files only, paths
    inside the archive, count and total size bounded), every file is created new (never
    through a link) strictly inside ``dest``, and every external data reference of the model
    must lie inside an unpacked file. Raises ``InvalidModel`` / ``ModelTooLarge``.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    root = dest.resolve()
    with _open_tar(source) as tar:
        members = archive_members(tar)
        model_member = archive_model_member(members, max_bytes=max_bytes)
        for member in members:
            if member.isdir():
                continue
            name = confined_path(member.name, what="archive member")
            target = root / name
            target.parent.mkdir(parents=True, exist_ok=True)
            parent = target.parent.resolve()
            if parent != root and root not in parent.parents:
                raise InvalidModel(f"archive member {name!r} would be written outside the "
                                   f"model's directory", member=name)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
            with (_open_member(tar, member) as data,
                  os.fdopen(os.open(parent / target.name, flags, 0o644), "wb") as out):
                shutil.copyfileobj(data, out, _CHUNK)
    model_path = root / confined_path(model_member.name, what="archive member")
    model = parse_model(model_path.read_bytes())
    check_external_refs(external_refs(model), archive_sizes(members))
    return model_path

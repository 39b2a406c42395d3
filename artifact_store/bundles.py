"""Custom-op plugin bundles: a folder with ``plugin.json`` packed as a deterministic tar.

The archive's sha256 is the bundle's digest (content addressing). Reading a bundle validates
it completely before anything is extracted: only regular files, every path confined to the
bundle (no absolute paths, no ``..``, no links), ``plugin.json`` a valid ``PluginManifest``,
every listed file present with its size and sha256, every implementation's file listed.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile
from pathlib import Path, PurePosixPath

from pydantic import ValidationError

from artifact_store.digest import sha256_file
from schemas.errors import IntegrityError, InvalidRequest
from schemas.plugins import PluginFile, PluginManifest, parse_plugin_manifest

MANIFEST_NAME = "plugin.json"
#: Refuse archives that unpack beyond this (a zip bomb is no plugin).
MAX_UNPACKED_BYTES = 2 * 1024**3


def _check_path(path: str) -> str:
    pure = PurePosixPath(path)
    if (not path or pure.is_absolute() or ".." in pure.parts or "\\" in path
            or path.startswith("~") or str(pure) != path.rstrip("/")):
        raise InvalidRequest(
            f"bundle path {path!r} escapes the bundle; expected a relative path inside it "
            "without '..'", path=path,
        )
    return str(pure)


def implementation_files(manifest: PluginManifest) -> set[str]:
    """The files the implementations and shape functions need, as bundle paths."""
    needed: set[str] = set()
    for impl in manifest.implementations:
        if impl.kind == "native":
            needed.add(_check_path(impl.entry))
        else:
            needed.add(impl.entry.split(":")[0].replace(".", "/") + ".py")
    for op in manifest.ops:
        if op.shape_function:
            needed.add(op.shape_function.split(":")[0].replace(".", "/") + ".py")
    return needed


def pack_bundle(src: Path, dest: Path) -> tuple[PluginManifest, str]:
    """Pack folder ``src`` (with ``plugin.json``) into the archive ``dest``.

    The manifest's ``files`` are filled with every file under ``src`` (sizes and sha256).
    The archive is deterministic (sorted, zero mtimes and owners): the same folder gives the
    same digest. Returns (manifest as packed, sha256 of the archive).
    """
    manifest_path = src / MANIFEST_NAME
    if not manifest_path.is_file():
        raise InvalidRequest(f"{src} has no {MANIFEST_NAME}; a plugin folder needs one")
    manifest = _parse_manifest(manifest_path.read_bytes(), str(manifest_path))
    files = []
    for path in sorted(p for p in src.rglob("*") if p.is_file() or p.is_symlink()):
        rel = path.relative_to(src).as_posix()
        if rel == MANIFEST_NAME or "__pycache__" in path.parts:
            continue
        if path.is_symlink():
            raise InvalidRequest(f"{rel} is a symbolic link; bundles hold regular files only")
        digest, size = sha256_file(path)
        files.append(PluginFile(path=_check_path(rel), sha256=digest, size=size))
    manifest = manifest.model_copy(update={"files": files})
    _check_complete(manifest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with (tempfile.NamedTemporaryFile(dir=dest.parent, prefix=".bundle-", delete=False) as tmp,
          tarfile.open(fileobj=tmp, mode="w") as tar):
        _add(tar, MANIFEST_NAME, manifest.model_dump_json(indent=2).encode())
        for entry in files:
            _add(tar, entry.path, (src / entry.path).read_bytes())
    os.replace(tmp.name, dest)
    return manifest, sha256_file(dest)[0]


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    info.mtime = 0
    tar.addfile(info, io.BytesIO(data))


def _parse_manifest(data: bytes, where: str) -> PluginManifest:
    try:
        return parse_plugin_manifest(json.loads(data))
    except (ValueError, ValidationError) as exc:
        raise InvalidRequest(f"{where} is not a valid plugin manifest: {exc}") from exc


def _check_complete(manifest: PluginManifest) -> None:
    listed = {f.path for f in manifest.files}
    missing = sorted(implementation_files(manifest) - listed)
    if missing:
        raise InvalidRequest(
            f"plugin {manifest.name} {manifest.version} names files it does not contain: "
            f"{missing}; it contains {sorted(listed)}", missing=missing,
        )


def read_bundle(archive: Path) -> PluginManifest:
    """Validate archive ``archive`` completely and return its manifest (nothing extracted)."""
    try:
        with tarfile.open(archive, mode="r:*") as tar:
            members = tar.getmembers()
            total = 0
            names: dict[str, tarfile.TarInfo] = {}
            for member in members:
                name = _check_path(member.name)
                if not member.isfile():
                    raise InvalidRequest(
                        f"bundle entry {member.name!r} is not a regular file (links, devices "
                        "and folders are refused)", path=member.name,
                    )
                total += member.size
                if total > MAX_UNPACKED_BYTES:
                    raise InvalidRequest(f"bundle unpacks beyond {MAX_UNPACKED_BYTES} bytes")
                names[name] = member
            if MANIFEST_NAME not in names:
                raise InvalidRequest(f"the archive has no {MANIFEST_NAME} at its root")
            manifest = _parse_manifest(_read(tar, names[MANIFEST_NAME]), MANIFEST_NAME)
            _check_complete(manifest)
            for entry in manifest.files:
                member = names.get(_check_path(entry.path))
                if member is None:
                    raise InvalidRequest(f"{entry.path} is listed in {MANIFEST_NAME} but not "
                                         "in the archive", path=entry.path)
                data = _read(tar, member)
                digest = hashlib.sha256(data).hexdigest()
                if len(data) != entry.size or digest != entry.sha256:
                    raise IntegrityError(
                        f"{entry.path} in bundle {manifest.name} {manifest.version} has sha256 "
                        f"{digest} ({len(data)} bytes); its manifest says {entry.sha256} "
                        f"({entry.size} bytes)", path=entry.path,
                    )
            extra = sorted(set(names) - {MANIFEST_NAME} - {f.path for f in manifest.files})
            if extra:
                raise InvalidRequest(f"the archive holds files its manifest does not list: "
                                     f"{extra}")
            return manifest
    except tarfile.TarError as exc:
        raise InvalidRequest(f"not a plugin bundle (a tar archive): {exc}") from exc


def _read(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    handle = tar.extractfile(member)
    if handle is None:
        raise InvalidRequest(f"cannot read {member.name!r} from the bundle")
    return handle.read()


def extract_bundle(archive: Path, dest: Path, *, digest: str | None = None) -> PluginManifest:
    """Verify ``archive`` (its sha256 against ``digest`` when given, then ``read_bundle``) and
    extract it to ``dest``, which appears whole or not at all."""
    if digest is not None:
        actual = sha256_file(archive)[0]
        if actual != digest:
            raise IntegrityError(f"plugin bundle {archive.name} has sha256 {actual}; expected "
                                 f"{digest}", expected=digest, actual=actual)
    manifest = read_bundle(archive)
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        with tarfile.open(archive, mode="r:*") as tar:
            for entry in [MANIFEST_NAME, *(f.path for f in manifest.files)]:
                target = staging / entry
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(_read(tar, tar.getmember(entry)))
        if dest.exists():
            shutil.rmtree(staging)
        else:
            os.replace(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest

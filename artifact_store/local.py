"""A store in a local directory: one file per key."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from artifact_store.base import ArtifactStore, check_key
from artifact_store.digest import CHUNK_SIZE
from schemas.errors import InvalidRequest, NotFound, StoreError

logger = logging.getLogger(__name__)


class LocalStore(ArtifactStore):
    """Objects are files under ``root`` (created if missing); key ``a/b`` is ``root/a/b``.

    Writes go to a hidden temporary file in the destination folder and are renamed into
    place, so a reader sees either the whole object or none.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.uri = self.root.as_uri()

    def _path(self, key: str) -> Path:
        path = (self.root / check_key(key)).resolve()
        if not path.is_relative_to(self.root):
            raise InvalidRequest(f"store key {key!r} resolves to {path}, outside {self.root}")
        return path

    def _put_file(self, key: str, src: Path) -> None:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
        try:
            with src.open("rb") as fsrc, os.fdopen(fd, "wb") as fdst:
                shutil.copyfileobj(fsrc, fdst, CHUNK_SIZE)
                fdst.flush()
                os.fsync(fdst.fileno())
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _get_range(self, key: str, start: int, end: int | None) -> Iterator[bytes]:
        path = self._path(key)
        try:
            f = path.open("rb")
        except (FileNotFoundError, IsADirectoryError) as exc:
            raise NotFound(f"no object {key!r} in {self.uri}", key=key) from exc
        with f:
            f.seek(start)
            remaining = None if end is None else end - start
            while remaining is None or remaining > 0:
                chunk = f.read(CHUNK_SIZE if remaining is None else min(CHUNK_SIZE, remaining))
                if not chunk:
                    break
                if remaining is not None:
                    remaining -= len(chunk)
                yield chunk

    def ping(self) -> None:
        """The root must still be a folder this process can write to."""
        if not self.root.is_dir():
            raise StoreError(f"the store folder {self.root} is gone; recreate it "
                             f"or fix KILN_STORE_URI")
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise StoreError(f"the store folder {self.root} is not writable by this process")

    def _size(self, key: str) -> int | None:
        path = self._path(key)
        return path.stat().st_size if path.is_file() else None

    def _delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def _list(self, prefix: str) -> Iterator[str]:
        # Walk only the deepest folder the prefix names; hidden (temporary) files are skipped.
        folder = self.root / prefix.rpartition("/")[0] if "/" in prefix else self.root
        if not folder.is_dir():
            return
        keys = []
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for name in filenames:
                if name.startswith("."):
                    continue
                key = name if rel == "." else f"{rel}/{name}"
                if key.startswith(prefix):
                    keys.append(key)
        yield from sorted(keys)

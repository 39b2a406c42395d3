"""Bytes in and out of the API: uploads streamed to a temporary file under the size limit,
and stored blobs served by a presigned redirect when the store has URLs (S3), otherwise
streamed by the API with HTTP Range for resumable pulls.

An upload's temporary files (``kiln-upload-*``, ``kiln-model-*``, ``kiln-build-blob-*`` and the
inspection child's scratch beside them) live in the serving process's own folder,
``$KILN_HOME/api-tmp/<pid>-<token>`` (``ScratchFolder``): a process killed mid-upload leaves
them there, and the next API process to start on that home removes them — only those of
processes that are gone, which it tells by the lock each live one holds on its folder.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Request, UploadFile
from fastapi.responses import RedirectResponse, StreamingResponse

from artifact_store.base import ArtifactStore
from schemas.errors import InvalidRequest, KilnError, PayloadTooLarge
from schemas.manifest import BlobRef

logger = logging.getLogger(__name__)

_CHUNK = 1 << 20

#: Under ``KILN_HOME``: one folder per serving process, and its lock file beside it.
SCRATCH_DIR = "api-tmp"
_LOCK = ".lock"
_NEW = ".new"


class ScratchFolder:
    """This process's folder for the temporary files of uploads: ``<root>/<pid>-<token>``,
    with ``<root>/<pid>-<token>.lock`` beside it, held (``flock``) for as long as the process
    lives. The kernel drops the lock when the process dies, however it dies (``kill -9``
    included), so a folder whose lock can be taken belongs to no live process. The pid in the
    name is for people reading the folder; liveness is the lock's, which a reused pid cannot
    fake.

    ``open`` first sweeps the folders of dead processes (and their lock files), then makes its
    own: the lock file is created and locked under a hidden name and renamed into place, so a
    sweep running beside it never sees it unlocked."""

    def __init__(self, root: Path, path: Path, lock_fd: int) -> None:
        self.root, self.path, self._lock_fd = root, path, lock_fd

    @classmethod
    def open(cls, root: Path) -> ScratchFolder:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        swept = sweep_scratch(root)
        if swept:
            logger.info("removed the temporary upload files of %d API processes that ended "
                        "without removing them: %s", len(swept), ", ".join(swept))
        attempts = 3
        while True:
            attempts -= 1
            name = f"{os.getpid()}-{secrets.token_hex(4)}"
            hidden = root / f".{name}{_LOCK}{_NEW}"
            fd = os.open(hidden, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                # Another process's sweep may have taken the file between its creation and
                # the lock (it looked like a dead process's): then the rename fails; retry.
                os.rename(hidden, root / f"{name}{_LOCK}")
                path = root / name
                path.mkdir(mode=0o700)
            except FileNotFoundError:
                os.close(fd)
                if not attempts:
                    raise
                continue
            except BaseException:
                os.close(fd)
                hidden.unlink(missing_ok=True)
                raise
            return cls(root, path, fd)

    def close(self) -> None:
        """Remove the folder (an upload still running loses its files) and its lock."""
        if self._lock_fd < 0:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        (self.root / f"{self.path.name}{_LOCK}").unlink(missing_ok=True)
        os.close(self._lock_fd)
        self._lock_fd = -1


def sweep_scratch(root: Path) -> list[str]:
    """Remove the scratch folders of processes that are gone: each whose lock file can be
    locked now (its owner's lock went with it), and a folder left with no lock file (a sweep
    that was itself interrupted). Returns the names removed. A folder whose lock is held is
    a live process's and is left alone."""
    removed: list[str] = []
    for entry in sorted(path.name for path in root.iterdir()):
        if entry.endswith(_LOCK) or entry.endswith(_LOCK + _NEW):
            name = entry.removeprefix(".").removesuffix(_NEW).removesuffix(_LOCK)
            try:
                fd = os.open(root / entry, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:  # another process's sweep took it
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    continue  # its process is alive
                raise
            try:
                if (root / name).is_dir():
                    shutil.rmtree(root / name, ignore_errors=True)
                    removed.append(name)
                (root / entry).unlink(missing_ok=True)
            finally:
                os.close(fd)
        elif (root / entry).is_dir() and not (root / f"{entry}{_LOCK}").exists():
            # The folder goes before its lock file, so a lock-less folder is the rest of a
            # sweep that was interrupted; a live process makes its lock file first (asked
            # again here, not from the listing, which may have missed one made meanwhile).
            shutil.rmtree(root / entry, ignore_errors=True)
            removed.append(entry)
    return removed


def scratch_of(request: Request) -> Path:
    """The serving process's folder for an upload's temporary files (opened at start-up)."""
    return request.app.state.scratch.path


_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")

DOWNLOAD_RESPONSES = {
    200: {"content": {"application/octet-stream": {}}, "description": "the bytes"},
    206: {"description": "the requested byte range"},
    307: {"description": "S3 store: redirect to a presigned URL"},
}


def blob_response(store: ArtifactStore, ref: BlobRef, range_header: str | None, *,
                  ttl_s: int):
    url = store.presigned_url(store.blob_key(ref.sha256), ttl_s)
    if url is not None:
        return RedirectResponse(url, status_code=307)
    headers = {"Accept-Ranges": "bytes", "ETag": f'"{ref.sha256}"', "X-Kiln-SHA256": ref.sha256}
    if range_header is None:
        headers["Content-Length"] = str(ref.size)
        return StreamingResponse(store.open_blob(ref), media_type=ref.media_type, headers=headers)
    match = _RANGE.match(range_header.strip())
    if match is None:
        raise InvalidRequest(f"unsupported Range {range_header!r}; expected 'bytes=START-[END]'")
    start = int(match.group(1))
    end = int(match.group(2)) + 1 if match.group(2) else ref.size
    if start >= ref.size or end <= start:
        raise InvalidRequest(f"Range {range_header!r} is outside the blob of {ref.size} bytes",
                             size=ref.size)
    end = min(end, ref.size)
    headers["Content-Range"] = f"bytes {start}-{end - 1}/{ref.size}"
    headers["Content-Length"] = str(end - start)
    return StreamingResponse(store.open_blob(ref, start=start, end=end), status_code=206,
                             media_type=ref.media_type, headers=headers)


@asynccontextmanager
async def received_upload(
    file: UploadFile, *, scratch: Path, max_bytes: int, what: str,
    empty_error: type[KilnError] = InvalidRequest, limit_name: str = "KILN_MAX_UPLOAD_BYTES",
    too_large: type[PayloadTooLarge] = PayloadTooLarge,
) -> AsyncIterator[tuple[Path, int]]:
    """The upload ``file`` written to a temporary file in ``scratch`` (``scratch_of``):
    (path, size), removed on exit. Over ``max_bytes`` (the setting ``limit_name``) raises
    ``too_large``; an empty upload raises ``empty_error``."""
    with tempfile.TemporaryDirectory(prefix="kiln-upload-", dir=scratch) as tmp:
        path = Path(tmp) / "upload"
        size = 0
        with path.open("wb") as out:
            while chunk := await file.read(_CHUNK):
                size += len(chunk)
                if size > max_bytes:
                    raise too_large(f"{what} is over the limit of {max_bytes} bytes "
                                    f"({limit_name})", limit_bytes=max_bytes)
                out.write(chunk)
        if size == 0:
            raise empty_error(f"the upload is empty; expected {what}")
        yield path, size

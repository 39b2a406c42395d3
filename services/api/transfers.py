"""Bytes in and out of the API: uploads streamed to a temporary file under the size limit,
and stored blobs served by a presigned redirect when the store has URLs (S3), otherwise
streamed by the API with HTTP Range for resumable pulls."""

from __future__ import annotations

import re
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import UploadFile
from fastapi.responses import RedirectResponse, StreamingResponse

from artifact_store import ArtifactStore
from schemas import BlobRef
from schemas.errors import InvalidRequest, KilnError, PayloadTooLarge

_CHUNK = 1 << 20

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
    file: UploadFile, *, max_bytes: int, what: str,
    empty_error: type[KilnError] = InvalidRequest, limit_name: str = "KILN_MAX_UPLOAD_BYTES",
    too_large: type[PayloadTooLarge] = PayloadTooLarge,
) -> AsyncIterator[tuple[Path, int]]:
    """The upload ``file`` written to a temporary file: (path, size), removed on exit.
    Over ``max_bytes`` (the setting ``limit_name``) raises ``too_large``; an empty upload
    raises ``empty_error``."""
    with tempfile.TemporaryDirectory(prefix="kiln-upload-") as tmp:
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

"""Streaming sha256: the content address of every blob."""

from __future__ import annotations

import hashlib
from pathlib import Path

#: Read and transfer size used throughout the store.
CHUNK_SIZE = 1 << 20


def sha256_file(path: Path) -> tuple[str, int]:
    """Return ``(hex sha256, size in bytes)`` of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    size = 0
    with Path(path).open("rb") as f:
        while chunk := f.read(CHUNK_SIZE):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size

"""Resumable, verified blob downloads.

Bytes go to ``<dest>.part``. A broken transfer is resumed with ``Range: bytes=<n>-`` (a few
attempts, with exponential backoff); a server that ignores the range restarts the file. Only
when the part file has exactly the promised size and sha256 is it renamed to ``dest``; a
mismatch deletes it and raises ``IntegrityError``. A redirect (an S3 presigned URL) is followed
by a client that carries no credentials.
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

import httpx

from artifact_store.digest import sha256_file
from runtime_agent.errors import ControlPlaneUnreachable, error_from_response
from schemas.errors import IntegrityError, KilnError

logger = logging.getLogger(__name__)

_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


class _Restart(Exception):
    """The part file is unusable for resuming; start the transfer over."""


def download(
    client: httpx.Client,
    url: str,
    dest: Path,
    *,
    size: int,
    sha256: str,
    attempts: int = 5,
    backoff_s: float = 0.5,
    redirect_client: httpx.Client | None = None,
) -> Path:
    """Download ``url`` to ``dest``, resuming ``<dest>.part``; verify ``size`` and ``sha256``.

    ``client`` sends the request (relative URLs resolve against its base URL, its headers may
    carry credentials); ``redirect_client`` (default: a bare one) follows a redirect. Raises
    ``IntegrityError`` for bytes that differ from the promise, ``ControlPlaneUnreachable`` when
    every attempt failed to connect or broke off, and the server's ``KilnError`` for an error
    response that retrying will not change.
    """
    dest = Path(dest)
    part = dest.with_name(dest.name + ".part")
    dest.parent.mkdir(parents=True, exist_ok=True)
    last_error: Exception | None = None
    for attempt in range(attempts):
        if attempt:
            delay = backoff_s * 2 ** (attempt - 1)
            logger.info("retrying %s in %.1fs (attempt %d of %d): %s", url, delay, attempt + 1,
                        attempts, last_error)
            time.sleep(delay)
        have = part.stat().st_size if part.exists() else 0
        if have > size:
            logger.warning("%s holds %d bytes, more than the %d expected; starting over", part,
                           have, size)
            part.unlink()
            have = 0
        if have == size:
            part.touch()
            break
        try:
            _transfer(client, redirect_client, url, part, have=have, size=size, sha256=sha256)
            break
        except _Restart as exc:
            part.unlink(missing_ok=True)
            last_error = exc
        except httpx.TransportError as exc:  # refused, timed out, or the body broke off
            last_error = exc
        except KilnError as exc:
            if not exc.transient:
                raise
            last_error = exc
    else:
        if isinstance(last_error, KilnError):
            raise last_error
        raise ControlPlaneUnreachable(
            f"could not download {url} after {attempts} attempts: {last_error}",
            url=str(url), attempts=attempts,
        )
    _verify_and_place(part, dest, size=size, sha256=sha256, url=str(url))
    return dest


def _transfer(
    client: httpx.Client,
    redirect_client: httpx.Client | None,
    url: str,
    part: Path,
    *,
    have: int,
    size: int,
    sha256: str,
) -> None:
    headers = {"Range": f"bytes={have}-"} if have else {}
    with client.stream("GET", url, headers=headers, follow_redirects=False) as response:
        if not response.is_redirect:
            _write(response, part, have=have, size=size, sha256=sha256)
            return
        location = response.url.join(response.headers["location"])
    logger.debug("following the redirect of %s to %s", url, location.copy_with(query=None))
    follower = redirect_client or httpx.Client(timeout=client.timeout)
    try:
        with follower.stream("GET", location, headers=headers, follow_redirects=True) as response:
            _write(response, part, have=have, size=size, sha256=sha256)
    finally:
        if redirect_client is None:
            follower.close()


def _write(response: httpx.Response, part: Path, *, have: int, size: int, sha256: str) -> None:
    status = response.status_code
    if status == 416:
        raise _Restart(f"the server refused the range bytes={have}- (HTTP 416)")
    if status >= 400:
        response.read()
        raise error_from_response(response, f"GET {response.url.copy_with(query=None)}")
    promised = response.headers.get("x-kiln-sha256")
    if promised and promised != sha256:
        raise IntegrityError(
            f"{response.url.copy_with(query=None)} serves sha256 {promised}; expected {sha256}",
            expected=sha256, served=promised,
        )
    if status == 206:
        match = _CONTENT_RANGE.match(response.headers.get("content-range", ""))
        if match is None or int(match.group(1)) != have:
            raise _Restart(
                f"asked for bytes {have}- and got Content-Range "
                f"{response.headers.get('content-range')!r}"
            )
        mode = "ab"
    else:
        if have:
            logger.info("%s ignored the range request; downloading from the start",
                        response.url.copy_with(query=None))
        have, mode = 0, "wb"
    written = have
    with part.open(mode) as out:
        for chunk in response.iter_bytes():  # unbuffered: a broken transfer keeps its prefix
            written += len(chunk)
            if written > size:
                part.unlink()
                raise IntegrityError(
                    f"{response.url.copy_with(query=None)} sent more than the {size} bytes "
                    f"expected (the partial file was deleted)",
                    expected_size=size,
                )
            out.write(chunk)
    if written < size:
        raise httpx.ReadError(f"the transfer ended after {written} of {size} bytes")


def _verify_and_place(part: Path, dest: Path, *, size: int, sha256: str, url: str) -> None:
    with part.open("rb+") as f:
        os.fsync(f.fileno())
    digest, actual = sha256_file(part)
    if actual != size or digest != sha256:
        part.unlink(missing_ok=True)
        raise IntegrityError(
            f"{url} delivered {actual} bytes with sha256 {digest}; expected {size} bytes with "
            f"sha256 {sha256} (the partial file was deleted)",
            url=url, expected_sha256=sha256, actual_sha256=digest, expected_size=size,
            actual_size=actual,
        )
    os.replace(part, dest)
    logger.debug("downloaded %s (%d bytes) to %s", url, size, dest)

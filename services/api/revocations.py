"""The revoked token ids as one API process sees them: read from the database at most every
``KILN_REVOCATION_REFRESH_S`` instead of a lookup per request.

Every authenticated request asks whether its token was revoked. A database lookup per request
was a large share of a heartbeat's own cost, and a hop to a worker thread (the first phase of
``bench/scale.py`` prints the API's CPU per heartbeat). The list of revoked,
unexpired tokens is short (a row goes once its token would have expired anyway), so the process
keeps it as a set and reads it again when it is older than ``refresh_s``:

- a revocation made through this process (``POST /v1/tokens/revoked``) is in the set at once;
- one made through another API replica is refused here within ``refresh_s`` (1 s by default);
- ``refresh_s`` 0 looks every token up in the database, as before.

``known(jti)`` answers from the set without blocking (the front door calls it on the event
loop). Once the set is older than ``refresh_s`` it starts one read in a thread of its own and
goes on answering from the set while that read runs, for at most ``STALE_GRACE_S`` more: when
a deployment keeps the API's worker threads busy for seconds, the requests of that second do
not each queue for a worker thread behind it (every heartbeat did; ``bench/scale.py`` reports
the heartbeats near a deployment change apart).
Past the grace (the database is slow or gone), ``known`` answers ``None`` and
``revoked(jti)``, in a worker thread, reads the list itself (one thread at a time; the others
wait for that read), so a list that cannot be read is never trusted for long. A background
read that failed is not tried again for ``refresh_s``: with the database gone, requests would
otherwise start one read after another, each waiting out the connection timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from sqlalchemy.orm import Session

from services.db import repo

logger = logging.getLogger(__name__)

#: How long past ``refresh_s`` the set still answers while its re-read runs, seconds.
STALE_GRACE_S = 2.0


class RevocationList:
    def __init__(self, session_factory: Callable[[], Session], *, refresh_s: float) -> None:
        self.session_factory = session_factory
        self.refresh_s = refresh_s
        self._lock = threading.Lock()
        self._jtis: frozenset[str] = frozenset()
        #: Revoked through this process: kept across reads, so that a read that began before
        #: the revocation committed cannot drop it.
        self._here: set[str] = set()
        #: ``time.monotonic()`` of the last read; ``None`` before the first.
        self._read_at: float | None = None
        #: ``time.monotonic()`` of the last background read that failed; ``None`` after one
        #: that succeeded.
        self._failed_at: float | None = None
        self.reads = 0

    def known(self, jti: str) -> bool | None:
        """Whether ``jti`` is revoked, from the set; ``None`` when it is older than
        ``refresh_s`` + ``STALE_GRACE_S`` (or was never read). A set older than ``refresh_s``
        is read again in the background meanwhile."""
        if self.refresh_s <= 0 or (age := self._age()) is None:
            return None
        if age > self.refresh_s:
            self._read_in_background()
            if age > self.refresh_s + STALE_GRACE_S:
                return None
        return self._has(jti)

    def _age(self) -> float | None:
        """Seconds since the set was read; ``None`` before the first read."""
        read_at = self._read_at
        return None if read_at is None else time.monotonic() - read_at

    def _has(self, jti: str) -> bool:
        return jti in self._jtis or jti in self._here

    def _read_in_background(self) -> None:
        """Start reading the list again in a thread of its own, unless a read is running or
        the last one failed less than ``refresh_s`` ago."""
        failed_at = self._failed_at
        if failed_at is not None and time.monotonic() - failed_at < self.refresh_s:
            return
        if not self._lock.acquire(blocking=False):
            return  # a read is running (in the background, or ``revoked``'s)
        thread = threading.Thread(target=self._background_read, name="kiln-revocations",
                                  daemon=True)
        try:
            thread.start()
        except BaseException:
            self._lock.release()
            raise

    def _background_read(self) -> None:
        try:
            self._read()
        except Exception as exc:  # the request path reads (and answers 503) past the grace
            self._failed_at = time.monotonic()
            logger.warning("could not read the revoked tokens again (%s: %s); answering from "
                           "the list read %.1f s ago", type(exc).__name__, exc,
                           time.monotonic() - (self._read_at or 0.0))
        finally:
            self._lock.release()

    def _read(self) -> None:
        """Read the list (the caller holds ``_lock``)."""
        started = time.monotonic()
        with self.session_factory() as session:
            self._jtis = repo.revoked_jtis(session)
        self._read_at = started
        self._failed_at = None
        self.reads += 1

    def revoked(self, jti: str) -> bool:
        """Whether ``jti`` is revoked, reading the list again first when it is stale (may
        block on the database: call it from a worker thread)."""
        if self.refresh_s <= 0:
            with self.session_factory() as session:
                return repo.token_revoked(session, jti=jti)
        with self._lock:  # a read running meanwhile (another thread's) is waited for
            if (age := self._age()) is None or age > self.refresh_s:
                self._read()
        return self._has(jti)

    def add(self, jti: str) -> None:
        """``jti`` was revoked through this process (after its commit)."""
        self._here.add(jti)

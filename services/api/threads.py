"""The threads an API process runs blocking work in.

Short work (a route's database reads and writes, the store's checks) runs in anyio's default
pool, bounded by ``KILN_API_THREADS``; no statement runs on the event loop itself
(``tests/services/api/test_event_loop.py``): every busy thread takes turns at the interpreter lock
with the event loop that answers heartbeats and held long-polls, so the pool is kept small.
Work that mostly waits on something else (the sandboxed inspection of an upload, its copy into
the store) runs through ``run_slow`` in a pool of its own (``KILN_API_SLOW_THREADS``), so
that a few large uploads never hold the threads short requests need. Desired-state
computations (a deployment wakes many profiles' long-polls at once) run through
``run_desired``, a few at a time (``KILN_API_DESIRED_STATE_THREADS``).

A request's database transaction never outlives the thread that opened it (``deps.Route``,
``deps.get_session``): FastAPI runs a plain ``def`` route, its response's validation and a
dependency's clean-up in separate hops through the default pool, and a transaction left open
across those hops held SQLite's write lock (every transaction there is ``BEGIN IMMEDIATE``)
or a pooled PostgreSQL connection while its next hop queued behind requests whose threads were
all blocked waiting for that lock or connection: the pool deadlocked on itself until the busy
or pool timeout, again and again. How many requests may use or wait for the database at once
is bounded too (``DatabaseAdmission``): the next ones wait a bounded time for a turn, then are
answered 503, instead of queueing without end.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.to_thread
from fastapi import FastAPI, Request
from sqlalchemy.orm import Session

from schemas.errors import DatabaseUnavailable
from services.config import KilnSettings

T = TypeVar("T")


def configure(app: FastAPI, settings: KilnSettings) -> None:
    """Size this event loop's pools (call it on the loop that serves ``app``)."""
    anyio.to_thread.current_default_thread_limiter().total_tokens = settings.api_threads
    app.state.slow_threads = anyio.CapacityLimiter(settings.api_slow_threads)
    app.state.desired_threads = anyio.CapacityLimiter(settings.api_desired_state_threads)
    app.state.db_admission = DatabaseAdmission(settings.api_max_db_requests,
                                               settings.api_db_queue_s)


class DatabaseAdmission:
    """At most ``limit`` requests of this process use the database at once; the next ones wait
    for a turn (on the event loop, which costs nothing while they wait) for up to ``wait_s``,
    then are refused (503, ``Retry-After``). Waiting rather than refusing at once keeps a crowd
    that retries on every refusal from spending the event loop on refusals (it then had no
    time left for ``/healthz``). Used on the event loop only. Also sizes the pool that ends
    requests' sessions (``finish``): every admitted request may need one of its threads, and
    none waits on what a queued request holds, so a session's end never waits for the
    default pool."""

    def __init__(self, limit: int, wait_s: float = 0.0) -> None:
        self.limit = limit
        self.wait_s = wait_s
        self.turns = anyio.Semaphore(limit)
        self.finishing = anyio.CapacityLimiter(limit)

    async def enter(self) -> None:
        try:
            self.turns.acquire_nowait()
            return
        except anyio.WouldBlock:
            pass
        if self.wait_s > 0:
            with anyio.move_on_after(self.wait_s):
                await self.turns.acquire()
                return
        raise DatabaseUnavailable(
            f"this API process is serving as many database requests as it takes at once "
            f"({self.limit}, KILN_API_MAX_DB_REQUESTS) and none finished within "
            f"{self.wait_s:g} s (KILN_API_DB_QUEUE_S); try again",
            reason="busy", limit=self.limit)

    def leave(self) -> None:
        self.turns.release()

    async def finish(self, fn: Callable[[], T], /) -> T:
        """``fn()`` (a session's rollback and close) in a thread outside the default pool."""
        return await anyio.to_thread.run_sync(fn, limiter=self.finishing)


async def run_slow(request: Request, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` in a thread of the slow pool."""
    return await _in_pool(request, "slow_threads", functools.partial(fn, *args, **kwargs))


async def committed(session: Session, fn: Callable[..., T], /, **kwargs: Any) -> T:
    """``fn(session, **kwargs)`` and the commit, in a thread of the default pool: how a
    coroutine route (an upload) writes. On the loop, a statement waiting for SQLite's write
    lock (the embedded stack) froze every request of the process for the busy timeout (seen
    in CI: 30 s, then a 503)."""

    def write() -> T:
        result = fn(session, **kwargs)
        session.commit()
        return result

    return await anyio.to_thread.run_sync(write)


async def run_desired(request: Request, fn: Callable[[], T], /) -> T:
    """``fn()`` in a thread of the desired-state pool."""
    return await _in_pool(request, "desired_threads", fn)


async def _in_pool(request: Request, pool: str, fn: Callable[[], T]) -> T:
    """``fn()`` in the pool ``configure`` set as ``app.state.<pool>`` (the default pool where
    the app was not started through its lifespan)."""
    return await anyio.to_thread.run_sync(fn, limiter=getattr(request.app.state, pool, None))

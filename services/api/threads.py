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
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.to_thread
from fastapi import FastAPI, Request
from sqlalchemy.orm import Session

from services.config import KilnSettings

T = TypeVar("T")


def configure(app: FastAPI, settings: KilnSettings) -> None:
    """Size this event loop's pools (call it on the loop that serves ``app``)."""
    anyio.to_thread.current_default_thread_limiter().total_tokens = settings.api_threads
    app.state.slow_threads = anyio.CapacityLimiter(settings.api_slow_threads)
    app.state.desired_threads = anyio.CapacityLimiter(settings.api_desired_state_threads)


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

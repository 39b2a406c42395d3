"""Liveness (``/healthz``: the process answers) and readiness (``/readyz``: the database,
the broker and the store each answer, with their latency)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy import text

from services.config import KilnSettings

router = APIRouter(tags=["health"])

#: A dependency that does not answer within this many seconds counts as down.
READY_TIMEOUT_S = 3.0
_probes = ThreadPoolExecutor(max_workers=6, thread_name_prefix="kiln-readyz")


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """Liveness: cheap, touches nothing. Readiness is ``/readyz``."""
    return {"status": "ok"}


def _broker_probe(settings: KilnSettings) -> Callable[[], None]:
    url = settings.broker_url or ""
    if url.startswith("filesystem"):
        def probe() -> None:
            folder = settings.broker_folder / "queue"
            if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
                raise OSError(f"the filesystem broker's folder {folder} is missing or "
                              f"not writable")
        return probe
    if url.startswith(("redis://", "rediss://", "unix://")):
        def probe() -> None:
            import redis

            client = redis.Redis.from_url(url, socket_connect_timeout=READY_TIMEOUT_S,
                                          socket_timeout=READY_TIMEOUT_S)
            try:
                client.ping()
            finally:
                client.close()
        return probe

    def probe() -> None:  # another kombu transport: one connection attempt
        from kombu import Connection

        with Connection(url, connect_timeout=READY_TIMEOUT_S) as conn:
            conn.ensure_connection(max_retries=1)
    return probe


def _check(probe: Callable[[], Any]) -> dict[str, Any]:
    start = time.perf_counter()
    future = _probes.submit(probe)
    try:
        future.result(timeout=READY_TIMEOUT_S)
    except FutureTimeout:
        return {"status": "down", "error": f"no answer within {READY_TIMEOUT_S:g} s",
                "latency_ms": round((time.perf_counter() - start) * 1000, 1)}
    except Exception as exc:  # any failure means "not ready", and the body says why
        message = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
        return {"status": "down", "error": message,
                "latency_ms": round((time.perf_counter() - start) * 1000, 1)}
    return {"status": "ok", "latency_ms": round((time.perf_counter() - start) * 1000, 1)}


@router.get("/readyz", responses={503: {"description": "a dependency is down; the body "
                                              "names it"}})
def readyz(request: Request) -> JSONResponse:
    """Readiness: ``200`` when the database, broker and store all answer, else ``503`` with
    ``down`` naming each one that did not, and why."""
    state = request.app.state

    def database() -> None:
        with state.session_factory() as session:
            session.execute(text("select 1"))

    probes = {"database": database, "broker": _broker_probe(state.settings),
              "store": state.store.ping}
    checks = {name: _check(probe) for name, probe in probes.items()}
    down = [name for name, check in checks.items() if check["status"] != "ok"]
    body = {"status": "unavailable" if down else "ready", "down": down, "checks": checks}
    return JSONResponse(body, status_code=503 if down else 200)

"""What a ``/readyz`` answers, shared by the API's and the compiler workers': each dependency's
probe (the API's database, broker and store; a worker's broker and the API) is asked once,
with a timeout, and reported with its latency; the answer is 503 naming each one that is
down. The probes are the caller's (each side has its own); nothing here reaches anything
itself, and no thread starts until a probe is asked."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

#: A dependency that does not answer within this many seconds counts as down.
READY_TIMEOUT_S = 3.0
_probes = ThreadPoolExecutor(max_workers=6, thread_name_prefix="kiln-readyz")

Probe = Callable[[], Any]


def check(probe: Probe) -> dict[str, Any]:
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


def readiness(probes: dict[str, Probe]) -> tuple[int, dict[str, Any]]:
    """(HTTP status, body): 200 when every probe answers, else 503 with ``down`` naming
    each one that did not, and why."""
    checks = {name: check(probe) for name, probe in probes.items()}
    down = [name for name, result in checks.items() if result["status"] != "ok"]
    body = {"status": "unavailable" if down else "ready", "down": down, "checks": checks}
    return (503 if down else 200), body

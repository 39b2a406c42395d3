"""The worker's own /healthz and /readyz: a real HTTP server in the worker's process, probing
a real broker and a real API. A worker reaches no database and no store, so it probes
neither: the API's own /readyz does."""

from __future__ import annotations

from pathlib import Path

import httpx

from compiler_worker.config import WorkerSettings
from compiler_worker.jobs import JobRunner
from compiler_worker.worker import HealthServer
from tests.conftest import free_port


def _serve(settings: WorkerSettings) -> HealthServer:
    server = HealthServer(JobRunner(settings), "127.0.0.1", 0)
    server.start()
    return server


def _readyz(settings: WorkerSettings) -> httpx.Response:
    server = _serve(settings)
    try:
        base = f"http://127.0.0.1:{server.port}"
        live = httpx.get(f"{base}/healthz", timeout=60)
        assert live.status_code == 200
        assert live.json() == {"status": "ok", "worker": "w1", "instance": settings.instance}
        assert httpx.get(f"{base}/nope", timeout=60).status_code == 404
        return httpx.get(f"{base}/readyz", timeout=10)
    finally:
        server.stop()


def test_readyz_probes_the_broker_and_the_api_and_names_the_one_down(
        tmp_path: Path, redis_url: str, live_api) -> None:
    closed = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    ready = live_api.worker_settings(tmp_path, broker_url=redis_url)
    broker_down = live_api.worker_settings(tmp_path, broker_url=closed)
    assert ready.instance != broker_down.instance  # a new id per process start
    api_down = live_api.worker_settings(tmp_path, broker_url=redis_url,
                                        worker_api_url=f"http://127.0.0.1:{free_port()}")

    answer = _readyz(ready)
    assert answer.status_code == 200, answer.text
    assert set(answer.json()["checks"]) == {"broker", "api"}
    assert answer.json()["down"] == []

    answer = _readyz(broker_down)
    assert answer.status_code == 503 and answer.json()["down"] == ["broker"], answer.text
    assert answer.json()["checks"]["api"]["status"] == "ok"

    answer = _readyz(api_down)
    assert answer.status_code == 503 and answer.json()["down"] == ["api"], answer.text
    assert "cannot reach the control plane" in answer.json()["checks"]["api"]["error"]

    live_api.stop()  # the API goes away under a running worker
    answer = _readyz(ready)
    assert answer.status_code == 503 and answer.json()["down"] == ["api"], answer.text

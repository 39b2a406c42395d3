"""The worker's own /healthz and /readyz: a real HTTP server in the worker's process, probing
a real database, broker and store."""

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


def test_readyz_names_the_broker_that_is_down(tmp_path: Path, redis_url: str) -> None:
    closed = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    ready = WorkerSettings(home=tmp_path, env="dev", worker_name="w1", broker_url=redis_url)
    down = WorkerSettings(home=tmp_path, env="dev", worker_name="w1", broker_url=closed)
    assert ready.instance != down.instance  # a new id per process start (settings object)
    (tmp_path / "store").mkdir()
    for settings, expected in ((ready, 200), (down, 503)):
        server = _serve(settings)
        try:
            base = f"http://127.0.0.1:{server.port}"
            live = httpx.get(f"{base}/healthz")
            assert live.status_code == 200
            assert live.json() == {"status": "ok", "worker": "w1",
                                   "instance": settings.instance}
            answer = httpx.get(f"{base}/readyz", timeout=10)
            assert answer.status_code == expected, answer.text
            body = answer.json()
            assert set(body["checks"]) == {"database", "broker", "store"}
            assert body["down"] == ([] if expected == 200 else ["broker"])
            assert body["checks"]["database"]["status"] == "ok"
            assert httpx.get(f"{base}/nope").status_code == 404
        finally:
            server.stop()

"""``/healthz`` stays cheap; ``/readyz`` answers 503 naming the dependency that is down."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from fastapi.testclient import TestClient

from services.api.app import create_app
from tests.conftest import free_port
from tests.services.api.conftest import make_settings


def test_readyz_checks_database_broker_and_store(api) -> None:
    response = api.get("/readyz")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "ready" and body["down"] == []
    assert set(body["checks"]) == {"database", "broker", "store"}
    for check in body["checks"].values():
        assert check["status"] == "ok" and check["latency_ms"] >= 0
    assert api.get("/healthz").json() == {"status": "ok"}


def test_readyz_names_an_unreachable_broker(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, broker_url=f"redis://127.0.0.1:{free_port()}/0")
    with TestClient(create_app(settings)) as api:
        start = time.perf_counter()
        response = api.get("/readyz")
        elapsed = time.perf_counter() - start
        assert response.status_code == 503, response.text
        body = response.json()
        assert body["down"] == ["broker"] and body["status"] == "unavailable"
        assert "Connection" in body["checks"]["broker"]["error"]
        assert body["checks"]["database"]["status"] == "ok"
        assert elapsed < 3.5  # bounded by the probe timeout, never a hang
        assert api.get("/healthz").status_code == 200  # alive, only not ready


def test_readyz_names_a_lost_store_folder(tmp_path: Path) -> None:
    settings = make_settings(tmp_path)
    with TestClient(create_app(settings)) as api:
        shutil.rmtree(tmp_path / "store")
        body = api.get("/readyz").json()
        assert body["down"] == ["store"]
        assert "is gone" in body["checks"]["store"]["error"]

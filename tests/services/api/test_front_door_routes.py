"""The front door finds a request's route without remembering anything a client sent: its
memory is one entry per route, however many distinct paths arrive (unauthenticated ones
included)."""

from __future__ import annotations

import tracemalloc

from fastapi.testclient import TestClient

from services.api.app import create_app
from services.api.gate import FrontDoor
from tests.services.api.conftest import bearer


def _front_door(app) -> FrontDoor:
    layer = app.middleware_stack
    while not isinstance(layer, FrontDoor):
        layer = layer.app
    return layer


def test_unique_unauthenticated_paths_are_not_kept(settings) -> None:
    app = create_app(settings)
    with TestClient(app, raise_server_exceptions=False) as client:
        client.get("/healthz")
        door = _front_door(app)
        entries = door.remembered()
        assert client.get("/v1/models/warm").status_code == 401
        tracemalloc.start()
        try:
            before, _ = tracemalloc.get_traced_memory()
            for index in range(1500):
                answer = client.get(f"/v1/models/{index:06d}{'y' * 10_000}")
                assert answer.status_code == 401
            after, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert door.remembered() == entries
        # 1,500 paths of 10 KB are 15 MB: kept, they would show.
        assert after - before < 3 * 1024 * 1024, f"{(after - before) / 2**20:.1f} MB kept"


def test_routes_are_still_told_apart(settings) -> None:
    app = create_app(settings)
    with TestClient(app, raise_server_exceptions=False) as client:
        client.headers["Authorization"] = bearer()
        assert client.get("/healthz").status_code == 200
        assert client.get("/v1/models").status_code == 200
        assert client.get("/v1/models/0123abcd").json()["code"] == "not_found"
        assert client.get("/v1/nothing/here").status_code == 404
        # A public path needs no token; every other path does, known or not.
        client.headers.pop("Authorization")
        assert client.get("/healthz").status_code == 200
        assert client.get("/v1/nothing/here").status_code == 401
        assert client.get("/v1/agents/a/heartbeat").status_code == 401

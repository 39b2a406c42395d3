from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from services.api.app import create_app
from services.api.auth import Role, mint_token
from services.config import KilnSettings

SECRET = "test-secret-0123456789abcdef-0123456789"


def make_settings(home: Path, **overrides) -> KilnSettings:
    return KilnSettings(home=home, secret_key=SECRET, max_upload_bytes=4 * 1024 * 1024, **overrides)


@pytest.fixture
def settings(tmp_path: Path) -> KilnSettings:
    return make_settings(tmp_path)


@pytest.fixture
def api(settings: KilnSettings) -> Iterator[TestClient]:
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        client.headers["Authorization"] = "Bearer " + mint_token(
            SECRET, role=Role.ADMIN, subject="test"
        )
        yield client


@pytest.fixture
def agent_token() -> str:
    return mint_token(SECRET, role=Role.AGENT, subject="node-1")

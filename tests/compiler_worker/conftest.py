"""Fixtures for the compiler tests."""

from __future__ import annotations

import pytest

from runtime_agent.fingerprint import detect_fingerprint
from schemas.fingerprint import HardwareFingerprint
from tests.plugins.helpers import example_bundles

__all__ = ["example_bundles", "fingerprint"]


@pytest.fixture(scope="session")
def fingerprint() -> HardwareFingerprint:
    """This machine's fingerprint: the build host of every compile in these tests."""
    return detect_fingerprint()


@pytest.fixture
def live_api(tmp_path):
    """A real API on loopback (SQLite, local store) for a worker to talk to."""
    from tests.compiler_worker.control_plane import LiveApi

    api = LiveApi(tmp_path / "control-plane").start()
    try:
        yield api
    finally:
        api.stop()

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

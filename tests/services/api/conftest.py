from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from schemas.fingerprint import CpuInfo, HardwareFingerprint
from services.api.app import create_app
from services.api.auth import Role, mint_token
from services.config import KilnSettings
from tests.conftest import migrated_sqlite

SECRET = "test-secret-0123456789abcdef-0123456789"

_X86_LEVELS = {
    "": [],
    "v2": ["cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"],
}
_X86_LEVELS["v3"] = [*_X86_LEVELS["v2"], "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm",
                     "movbe", "xsave"]
_X86_LEVELS["v4"] = [*_X86_LEVELS["v3"], "avx512f", "avx512bw", "avx512cd", "avx512dq",
                     "avx512vl"]


def node_fingerprint(key: str, *, torch: str | None = None) -> HardwareFingerprint:
    """A CPU node's fingerprint from which the onnxruntime executor derives ``key``
    (``ort-cpu-x86-64[-v2|-v3|-v4]-ort<major.minor>``), with ``torch`` (a version) for an
    AOTInductor key too: the API refuses an agent whose keys its fingerprint does not
    derive."""
    match = re.fullmatch(r"ort-cpu-x86-64(?:-(v[234]))?-ort(\d+\.\d+)", key)
    assert match, f"no test fingerprint for key {key!r}"
    level, version = match.group(1) or "", match.group(2)
    runtimes = {"onnxruntime": f"{version}.0"}
    if torch is not None:
        runtimes["torch"] = torch
    return HardwareFingerprint(cpu=CpuInfo(arch="x86_64", features=_X86_LEVELS[level]),
                               runtimes=runtimes)


def registration(name: str, key: str, labels: dict[str, str] | None = None, *,
                 torch: str | None = None) -> dict:
    """A registration body for agent ``name`` on the CPU node of ``key``, with the keys the
    key rules derive for it."""
    from schemas.technologies import node_compatibility_keys, node_fingerprint_keys

    fingerprint = node_fingerprint(key, torch=torch)
    return {"name": name, "labels": labels or {},
            "fingerprint": fingerprint.model_dump(mode="json"),
            "fingerprint_keys": node_fingerprint_keys(fingerprint),
            "compatibility_keys": node_compatibility_keys(fingerprint)}


def bearer(role: Role = Role.ADMIN, *, agent: str | None = None, ttl_s: int = 3600,
           secret: str = SECRET, subject: str = "test") -> str:
    """``Bearer <token>`` for ``role`` (an agent token for ``agent``; a worker token for any
    fingerprint key)."""
    return "Bearer " + mint_token(secret, role=role, subject=subject, ttl_s=ttl_s, agent=agent,
                                  keys=["*"] if role is Role.WORKER else None)


def make_settings(home: Path, **overrides) -> KilnSettings:
    """Settings for an API on ``home``; without a ``database_url``, its default SQLite file
    starts as a copy of the run's migrated template (the app's own migration then finds it at
    head). The URL stays unset, so the settings still count the database as defaulted."""
    if overrides.get("database_url") is None:
        migrated_sqlite(home.resolve() / "kiln.db")
    overrides.setdefault("api_docs", True)
    # These tests set states up behind the API's back (artifacts recorded straight into the
    # database) and ask for desired state at once; the cache, which hears of such writes
    # only through the once-a-second re-check, is tested on its own (test_desired_cache).
    overrides.setdefault("desired_state_cache_s", 0)
    return KilnSettings(home=home, secret_key=SECRET, max_upload_bytes=4 * 1024 * 1024, **overrides)


@pytest.fixture
def settings(tmp_path: Path) -> KilnSettings:
    return make_settings(tmp_path)


@pytest.fixture
def api(settings: KilnSettings) -> Iterator[TestClient]:
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        client.headers["Authorization"] = bearer()
        yield client


@pytest.fixture
def agent_token() -> str:
    return mint_token(SECRET, role=Role.AGENT, subject="node-1", agent="node-1",
                      ttl_s=3600)

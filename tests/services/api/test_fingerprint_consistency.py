"""A declared fingerprint no CPU has is refused at registration with a 422 naming what is
inconsistent, and nothing is written or queued."""

from __future__ import annotations

import pytest

from kiln.examples import mlp
from runtime_agent.executors import node_compatibility_keys, node_fingerprint_keys
from schemas.fingerprint import CpuInfo, HardwareFingerprint
from tests.services.api.test_api import queued_messages, upload
from tests.services.api.test_fleet import deploy

V3 = ["ssse3", "sse4_1", "sse4_2", "popcnt", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2"]

CASES = {
    "AMX on aarch64": (CpuInfo(arch="aarch64", features=["neon", "dotprod", "amx_tile"]),
                       "amx_tile"),
    "a level without its baseline": (CpuInfo(arch="x86_64", features=["avx2", "avx512f"]),
                                     "without the baseline"),
}


def _body(cpu: CpuInfo) -> dict:
    fingerprint = HardwareFingerprint(cpu=cpu, runtimes={"onnxruntime": "1.32.0"})
    return {"name": "variant-1", "labels": {}, "fingerprint": fingerprint.model_dump(mode="json"),
            "fingerprint_keys": node_fingerprint_keys(fingerprint),
            "compatibility_keys": node_compatibility_keys(fingerprint)}


@pytest.mark.parametrize("case", list(CASES))
def test_an_inconsistent_fingerprint_is_422_naming_it(api, settings, case):
    model_id = upload(api, mlp().SerializeToString()).json()["id"]
    assert deploy(api, "everywhere", model_id, {}).status_code == 201
    cpu, needle = CASES[case]
    response = api.post("/v1/agents", json=_body(cpu))
    assert response.status_code == 422, response.text
    body = response.json()
    assert body["code"] == "fingerprint_inconsistent" and needle in body["message"]
    assert any(needle in p for p in body["details"]["problems"])
    assert api.get("/v1/agents").json() == []
    assert api.get("/v1/compile-jobs").json() == [] and queued_messages(settings) == []


def test_a_consistent_variant_registers(api):
    response = api.post("/v1/agents", json=_body(CpuInfo(arch="x86_64", features=V3, cores=64)))
    assert response.status_code in (200, 201), response.text

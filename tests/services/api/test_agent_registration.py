"""What an agent reports is validated and bounded before anything is written: a bad name,
label, key or fingerprint is a 422 naming the field, and no row or job appears."""

from __future__ import annotations

import pytest

from kiln.examples import mlp
from schemas.agents import MAX_LABELS, MAX_MODELS
from tests.services.api.test_api import queued_messages, upload
from tests.services.api.test_fleet import FP, KEY, deploy

GOOD = {"name": "edge-1", "labels": {"site": "a"}, "fingerprint": FP.model_dump(mode="json"),
        "fingerprint_keys": {"onnxruntime": KEY}}


def _with(**changes) -> dict:
    body = {**GOOD, **changes}
    return {k: v for k, v in body.items() if v is not None}


def _fingerprint(**cpu) -> dict:
    document = FP.model_dump(mode="json")
    document["cpu"].update(cpu)
    return document


BAD = {
    "malformed key": (_with(fingerprint_keys={"onnxruntime": "bad key!"}), "fingerprint_keys"),
    "key with a slash": (_with(fingerprint_keys={"onnxruntime": "../x"}), "fingerprint_keys"),
    "key too long": (_with(fingerprint_keys={"onnxruntime": "k" * 201}), "fingerprint_keys"),
    "backend name": (_with(fingerprint_keys={"Onnx Runtime": KEY}), "fingerprint_keys"),
    "too many backends": (_with(fingerprint_keys={f"b{i}": KEY for i in range(17)}),
                          "fingerprint_keys"),
    "compatibility key": (_with(compatibility_keys={"onnxruntime": ["ok", "not ok"]}),
                          "compatibility_keys"),
    "too many compatibility keys": (_with(compatibility_keys={
        "onnxruntime": [f"k{i}" for i in range(33)]}), "compatibility_keys"),
    "label key": (_with(labels={"bad key": "x"}), "labels"),
    "label value": (_with(labels={"site": "a b\n"}), "labels"),
    "too many labels": (_with(labels={f"l{i}": "x" for i in range(MAX_LABELS + 1)}), "labels"),
    "agent name": (_with(name="../etc"), "name"),
    "serve url": (_with(serve_url="javascript:alert(1)"), "serve_url"),
    "too many CPU features": (_with(fingerprint=_fingerprint(features=["f"] * 1025)),
                              "fingerprint is out of bounds"),
    "huge CPU model text": (_with(fingerprint=_fingerprint(model="x" * 10_000)),
                            "text field of 10000"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_registrations_are_422_and_write_nothing(api, settings, case):
    model_id = upload(api, mlp().SerializeToString()).json()["id"]
    assert deploy(api, "everywhere", model_id, {}).status_code == 201
    body, needle = BAD[case]
    response = api.post("/v1/agents", json=body)
    assert response.status_code == 422, response.text
    assert needle in response.text
    assert api.get("/v1/agents").json() == []
    assert api.get("/v1/compile-jobs").json() == [] and queued_messages(settings) == []


def test_a_heartbeat_is_bounded_too(api):
    assert api.post("/v1/agents", json=GOOD).status_code == 200
    status = {"deployment": "d", "state": "serving"}
    too_many = api.post("/v1/agents/edge-1/heartbeat", json={"models": [status] * (MAX_MODELS + 1)})
    assert too_many.status_code == 422 and "models" in too_many.text
    long_name = api.post("/v1/agents/edge-1/heartbeat",
                         json={"models": [{**status, "deployment": "d" * 129}]})
    assert long_name.status_code == 422
    assert api.post("/v1/agents/edge-1/heartbeat", json={"models": [status]}).status_code == 200


@pytest.mark.parametrize(("claim", "needle"), [
    ({"fingerprint_keys": {"onnxruntime": "ort-cpu-x86-64-v4-ort1.32"}},
     "claims fingerprint key 'ort-cpu-x86-64-v4-ort1.32' for backend 'onnxruntime', but the "
     "control plane's key rules derive 'ort-cpu-x86-64-v3-ort1.32'"),
    ({"fingerprint_keys": {"tensorrt": "trt-sm90-h100-trt10.0"}},
     "claims fingerprint key 'trt-sm90-h100-trt10.0' for backend 'tensorrt', but the control "
     "plane's key rules have no key for it on this hardware"),
    ({"fingerprint_keys": {"onnxruntime": KEY}, "compatibility_keys": {
        "onnxruntime": ["ort-cpu-x86-64-portable-ort1.32", "ort-cpu-anything-ort1.32"]}},
     "compatibility key(s) ['ort-cpu-anything-ort1.32']"),
])
def test_a_key_the_fingerprint_does_not_derive_is_400_and_queues_nothing(api, settings, claim,
                                                                         needle):
    model_id = upload(api, mlp().SerializeToString()).json()["id"]
    assert deploy(api, "everywhere", model_id, {}).status_code == 201
    response = api.post("/v1/agents", json={**GOOD, **claim})
    assert response.status_code == 400, response.text
    assert needle in response.json()["message"]
    assert api.get("/v1/agents").json() == []
    assert api.get("/v1/compile-jobs").json() == [] and queued_messages(settings) == []
    # The honest claim registers, and queues the node's build.
    assert api.post("/v1/agents", json=GOOD).status_code == 200
    assert len(api.get("/v1/compile-jobs").json()) == 1

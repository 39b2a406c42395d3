"""``/v1/datasets`` and the datasets a compile request names, against SQLite and the local
store: round trip and dedupe, hostile uploads answered 4xx, datasets checked against the
model's inputs before any job is written."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import numpy as np
import pytest
from fastapi.testclient import TestClient

from artifact_store.registry import open_store
from kiln.examples import small_cnn
from services.api.app import create_app
from tests.schemas.test_datasets import npy_header, npz, zip_of
from tests.services.api.conftest import bearer, make_settings

KEY = "ort-cpu-x86-64-v3-ort1.32"


def push(api, data: bytes, **kwargs):
    return api.post("/v1/datasets", files={"file": ("samples.npz", data)}, **kwargs)


def images(n: int, *per_sample: int) -> bytes:
    rng = np.random.default_rng(0)
    return npz(image=rng.standard_normal((n, *per_sample), dtype=np.float32))


def model(api, **kwargs) -> str:
    response = api.post("/v1/models", files={"file": ("m.onnx",
                                                       small_cnn(**kwargs).SerializeToString())})
    assert response.status_code == 201, response.text
    return response.json()["id"]


def compile_request(api, model_id: str, **options):
    return api.post("/v1/compile-jobs", json={
        "model_id": model_id, "targets": [{"fingerprint_key": KEY}], "options": options})


def test_round_trip_and_the_same_bytes_are_the_same_dataset(api, settings):
    data = images(4, 1, 3, 32, 32)
    first = push(api, data)
    assert first.status_code == 201, first.text
    info = first.json()
    assert info["id"] == hashlib.sha256(data).hexdigest()
    assert info["size_bytes"] == len(data)
    assert info["tensors"] == [{"name": "image", "dtype": "float32", "shape": [4, 1, 3, 32, 32]}]
    again = push(api, data)
    assert again.status_code == 200 and again.json() == info
    assert api.get("/v1/datasets").json() == [info]
    assert api.get(f"/v1/datasets/{info['id']}").json() == info
    store = open_store(settings.store_uri)
    assert store.get_bytes(store.blob_key(info["id"])) == data


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"", "the upload is empty"),
        (b"PK\x03\x04 but not really a zip", "not a zip archive"),
        (npz(), "holds no arrays"),
        (npz(x=np.array([{"a": 1}, None], dtype=object)), "pickled object arrays are refused"),
        (zip_of({"image.npy": npy_header((1 << 40, 1 << 40, 3)) + b"\0" * 12}), "claims shape"),
    ],
    ids=["empty-upload", "not-zip", "empty-npz", "pickled-object", "huge-shape-header"],
)
def test_hostile_uploads_are_400_with_what_was_expected(api, data, needle):
    response = push(api, data)
    assert response.status_code == 400, response.text
    assert response.json()["code"] == "invalid_request"
    assert needle in response.json()["message"], response.json()["message"]
    assert api.get("/v1/datasets").json() == []
    assert api.get("/healthz").status_code == 200


@pytest.fixture
def small_limit_api(tmp_path) -> Iterator[TestClient]:
    settings = make_settings(tmp_path, max_dataset_bytes=64 * 1024)
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        client.headers["Authorization"] = bearer()
        yield client


def test_over_the_configured_limit_is_refused(small_limit_api):
    oversized = push(small_limit_api, npz(x=np.zeros((2, 10_000), np.float32)))
    assert oversized.status_code == 413, oversized.text
    assert "KILN_MAX_DATASET_BYTES" in oversized.json()["message"]
    assert oversized.json()["code"] == "payload_too_large"  # not a model
    assert str(64 * 1024) in oversized.json()["message"]
    bomb = push(small_limit_api, npz(True, x=np.zeros((2, 100_000), np.float32)))
    assert bomb.status_code == 400, bomb.text
    assert "unpack to 800128 bytes, over the limit" in bomb.json()["message"]
    assert push(small_limit_api, npz(x=np.zeros((2, 1000), np.float32))).status_code == 201
    assert len(small_limit_api.get("/v1/datasets").json()) == 1


def test_who_may_push_and_read(api, agent_token):
    data = images(2, 1, 3, 32, 32)
    assert push(api, data, headers={"Authorization": ""}).status_code == 401
    assert api.get("/v1/datasets", headers={"Authorization": ""}).status_code == 401
    agent = {"Authorization": f"Bearer {agent_token}"}
    forbidden = push(api, data, headers=agent)
    assert forbidden.status_code == 403 and "admin" in forbidden.json()["message"]
    dataset_id = push(api, data).json()["id"]
    assert api.get(f"/v1/datasets/{dataset_id}", headers=agent).status_code == 200


def test_unknown_dataset_is_404_and_writes_no_job(api):
    model_id = model(api, batch=1)
    for option in ("samples", "calibration"):
        response = compile_request(api, model_id, **{option: "a" * 64})
        assert response.status_code == 404, response.text
        message = response.json()["message"]
        assert f"options.{option}" in message and "a" * 64 in message
        assert "POST /v1/datasets" in message
    assert api.get(f"/v1/datasets/{'a' * 64}").status_code == 404
    assert api.get("/v1/compile-jobs").json() == []


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (images(4, 3, 32, 32), "input 'image' has shape [1, 3, 32, 32]"),  # batch axis left out
        (images(4, 1, 3, 16, 16), "input 'image' has shape"),
        (npz(image=np.zeros((4, 1, 3, 32, 32), np.float64)), "input 'image' is float32"),
        (npz(pixels=np.zeros((4, 1, 3, 32, 32), np.float32)), "missing ['image']"),
    ],
    ids=["no-batch-axis", "wrong-size", "wrong-dtype", "wrong-name"],
)
def test_a_dataset_that_does_not_fit_the_model_is_422_naming_the_input(api, data, needle):
    model_id = model(api, batch=1)
    dataset_id = push(api, data).json()["id"]
    for option in ("samples", "calibration"):
        response = compile_request(api, model_id, **{option: dataset_id})
        assert response.status_code == 422, response.text
        assert response.json()["code"] == "invalid_options"
        assert needle in response.json()["message"], response.json()["message"]
        assert f"options.{option}" in response.json()["message"]
    deploy = api.post("/v1/deployments", json={"name": "svc", "model_id": model_id,
                                               "options": {"samples": dataset_id}})
    assert deploy.status_code == 422 and needle in deploy.json()["message"]
    assert api.get("/v1/compile-jobs").json() == []


def test_fitting_datasets_are_accepted_for_fixed_and_dynamic_batch(api):
    fixed = model(api, batch=1)
    dynamic = model(api, batch="N", seed=1)
    one = push(api, images(4, 1, 3, 32, 32)).json()["id"]
    eight = push(api, images(2, 8, 3, 32, 32)).json()["id"]
    assert compile_request(api, fixed, samples=one, calibration=one).status_code == 202
    assert compile_request(api, dynamic, samples=eight).status_code == 202
    assert compile_request(api, dynamic, samples=one).status_code == 202
    mismatch = compile_request(api, fixed, samples=eight)
    assert mismatch.status_code == 422 and "[8, 3, 32, 32]" in mismatch.json()["message"]
    # dynamic int8 needs no calibration data
    assert compile_request(api, fixed, precision="int8").status_code == 202

"""The agent's inference server through FastAPI's TestClient, on a real compiled artifact."""

from __future__ import annotations

import io
import json
import re

import numpy as np
import pytest
from fastapi.testclient import TestClient

from runtime_agent.artifact_dir import load_artifact
from runtime_agent.server import NPZ, create_app, decode_json
from runtime_agent.serving import ModelTable, ServedModel
from schemas.errors import InvalidRequest
from schemas.manifest import TensorSpec
from tests.runtime_agent.helpers import Fixtures

LIMIT = 1 << 20


@pytest.fixture(scope="module")
def table(built: Fixtures) -> ModelTable:
    models = ModelTable()
    models.put(ServedModel("mlp", load_artifact(built.mlp_a)))
    return models


@pytest.fixture
def client(table: ModelTable) -> TestClient:
    return TestClient(create_app(table, max_body_bytes=LIMIT))


@pytest.fixture(scope="module")
def session(built: Fixtures):
    import onnxruntime as ort

    return ort.InferenceSession(str(built.mlp_a / "engine.onnx"),
                                providers=["CPUExecutionProvider"])


def npz(**arrays: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


X = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)


def test_json_round_trip_matches_onnxruntime(client, session, table) -> None:
    response = client.post("/v1/models/mlp/infer", json={"inputs": {"x": X.tolist()}})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["artifact_id"] == table.get("mlp").artifact_id
    assert response.headers["x-kiln-artifact-id"] == body["artifact_id"]
    expected = session.run(None, {"x": X})[0]
    np.testing.assert_allclose(np.asarray(body["outputs"]["y"], np.float32), expected,
                               rtol=1e-6, atol=1e-6)


def test_npz_round_trip_matches_onnxruntime(client, session) -> None:
    response = client.post("/v1/models/mlp/infer", content=npz(x=X),
                           headers={"Content-Type": NPZ, "Accept": NPZ})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == NPZ
    with np.load(io.BytesIO(response.content), allow_pickle=False) as outputs:
        assert outputs.files == ["y"]
        np.testing.assert_array_equal(outputs["y"], session.run(None, {"x": X})[0])
    as_json = client.post("/v1/models/mlp/infer", content=npz(x=X), headers={"Content-Type": NPZ})
    assert as_json.headers["content-type"] == "application/json"
    assert np.asarray(as_json.json()["outputs"]["y"]).shape == (4, 16)


def _object_npz() -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, x=np.array([{"a": 1}], dtype=object), allow_pickle=True)
    return buffer.getvalue()


def _npy() -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, X)
    return buffer.getvalue()


def _bomb() -> bytes:
    buffer = io.BytesIO()
    np.savez_compressed(buffer, x=np.zeros((LIMIT // 2, 64), np.float32))
    return buffer.getvalue()


def _lying_npz(shape: tuple[int, ...], descr: str = "<f4") -> bytes:
    """An npz whose ``x.npy`` header claims ``shape`` over a few bytes of data."""
    from tests.schemas.test_datasets import npy_header, zip_of

    return zip_of({"x.npy": npy_header(shape, descr) + b"\0" * 64})


J = "application/json"
BAD = [
    # (name, content type, body, status, code, message)
    ("unknown input", J, {"inputs": {"z": [[1.0]]}}, 400, "invalid_request",
     r"expected inputs \[x: float32\['N', 64\]\]; given \['z'\] \(missing \['x'\], "
     r"unexpected \['z'\]\)"),
    ("no inputs key", J, {"x": [[1.0]]}, 400, "invalid_request", r'expected a JSON object'),
    ("not an object", J, [1, 2], 400, "invalid_request", r'expected a JSON object'),
    ("malformed JSON", J, b'{"inputs": {"x": [[1.0,', 400, "invalid_request", "not valid JSON"),
    ("strings", J, {"inputs": {"x": [["a"] * 64]}}, 400, "invalid_request",
     r"input 'x' \(float32\['N', 64\]\): expected numbers; given strings"),
    ("booleans", J, {"inputs": {"x": [[True] * 64]}}, 400, "invalid_request",
     "expected numbers; given booleans"),
    ("ragged", J, {"inputs": {"x": [[1.0] * 64, [1.0]]}}, 400, "invalid_request",
     "expected a nested list of numbers"),
    ("wrong rank", J, {"inputs": {"x": [1.0] * 64}}, 400, "invalid_request",
     r"expected rank 2 \(x: float32\['N', 64\]\); given shape \[64\]"),
    ("wrong dimension", J, {"inputs": {"x": [[1.0] * 63]}}, 400, "invalid_request",
     r"expected dimension 1 to be 64"),
    ("npz garbage", NPZ, b"PK\x03\x04 not really a zip", 400, "invalid_request",
     "not an npz archive"),
    ("npy, not npz", NPZ, _npy(), 400, "invalid_request", "got a single .npy array"),
    ("pickled object array", NPZ, _object_npz(), 400, "invalid_request",
     "array 'x' of the npz cannot be read"),
    ("npz wrong dtype", NPZ, npz(x=X.astype(np.float64)), 400, "invalid_request",
     "expected dtype float32"),
    ("npz extra array", NPZ, npz(x=X, mask=X), 400, "invalid_request", r"unexpected \['mask'\]"),
    ("zip bomb", NPZ, _bomb(), 413, "payload_too_large", "unpack to 134217728 bytes"),
    ("body too large", J, {"inputs": {"x": [[0.5] * 64] * 20_000}}, 413, "payload_too_large",
     f"over the limit of {LIMIT} bytes"),
    ("unsupported type", "text/csv", b"1,2,3", 400, "invalid_request",
     "unsupported Content-Type 'text/csv'"),
    # Bounded before anything is built or allocated:
    ("deep nesting", J, b'{"inputs": {"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}", 400,
     "invalid_request", "nests 100002 levels deep; at most 64"),
    ("unbalanced nesting", J, b"[" * 100_000, 400, "invalid_request", "nests 100000 levels"),
    ("brackets in strings do not count", J, {"inputs": {"x": [["[" * 500] * 64]}}, 400,
     "invalid_request", "expected numbers; given strings"),
    ("npz header claiming 4 TiB", NPZ, _lying_npz((1 << 34, 64)), 413, "payload_too_large",
     r"unpack to 4398046511104 bytes as their headers declare .*nothing was allocated"),
    ("npz header claiming the wrong shape", NPZ, _lying_npz((4, 63)), 400, "invalid_request",
     r"expected shape \['N', 64\] .*the npz declares \[4, 63\]"),
    ("npz header claiming the wrong dtype", NPZ, _lying_npz((4, 64), "<i8"), 400,
     "invalid_request", "expected dtype float32 .* the npz declares int64"),
]


@pytest.mark.parametrize(("content_type", "body", "status", "code", "message"),
                         [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_input_is_a_clear_4xx(client, content_type, body, status, code, message) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = client.post("/v1/models/mlp/infer", content=data,
                           headers={"Content-Type": content_type})
    assert response.status_code == status, response.text
    error = response.json()
    assert error["code"] == code
    assert re.search(message, error["message"]), error["message"]
    # ... and the server keeps serving.
    ok = client.post("/v1/models/mlp/infer", json={"inputs": {"x": X[:1].tolist()}})
    assert ok.status_code == 200


def test_unknown_model_and_route_are_404_with_what_exists(client) -> None:
    response = client.post("/v1/models/resnet/infer", json={"inputs": {}})
    assert response.status_code == 404
    assert response.json()["message"] == ("no model named 'resnet' is loaded on this agent; "
                                          "loaded models are ['mlp']")
    assert response.json()["details"]["loaded"] == ["mlp"]
    response = client.get("/v9/nothing")
    assert response.status_code == 404 and "routes are" in response.json()["message"]
    assert client.get("/v1/models/mlp/infer").status_code == 405


def test_models_metrics_and_health(built: Fixtures) -> None:
    table = ModelTable()
    model = ServedModel("mlp", load_artifact(built.mlp_b), tier="exact")
    table.put(model)
    client = TestClient(create_app(table))
    for _ in range(5):
        assert client.post("/v1/models/mlp/infer", json={"inputs": {"x": X.tolist()}}).is_success
    assert client.post("/v1/models/mlp/infer", json={"inputs": {}}).status_code == 400

    [listed] = client.get("/v1/models").json()
    assert listed["name"] == "mlp" and listed["artifact_id"] == model.artifact_id
    assert listed["tier"] == "exact" and listed["backend"] == "onnxruntime"
    assert listed["inputs"] == [{"name": "x", "dtype": "float32", "shape": ["N", 64]}]
    stats = listed["stats"]
    assert stats["count"] == 6 and stats["errors"] == 1
    assert 0 < stats["p50_ms"] <= stats["p90_ms"]

    text = client.get("/metrics").text
    labels = f'artifact="{model.artifact_id}",model="mlp"'
    assert f'kiln_agent_requests_total{{{labels},outcome="ok"}} 5.0' in text
    assert f'kiln_agent_requests_total{{{labels},outcome="invalid_request"}} 1.0' in text
    assert f"kiln_agent_request_seconds_count{{{labels}}} 5.0" in text
    assert (f'kiln_agent_model_info{{artifact="{model.artifact_id}",backend="onnxruntime",'
            f'model="mlp",tier="exact"}} 1.0') in text
    assert client.get("/healthz").json() == {"status": "ok", "models": ["mlp"]}


def test_json_conversion_refuses_lossy_values() -> None:
    ids = [TensorSpec(name="ids", dtype="int8", shape=["N"])]
    assert decode_json(b'{"inputs": {"ids": [1, 2, -3]}}', ids)["ids"].dtype == np.int8
    with pytest.raises(InvalidRequest, match="expected integers; given non-integer numbers"):
        decode_json(b'{"inputs": {"ids": [1.5]}}', ids)
    with pytest.raises(InvalidRequest, match=r"values must lie in \[-128, 127\]"):
        decode_json(b'{"inputs": {"ids": [300]}}', ids)
    mask = [TensorSpec(name="m", dtype="bool", shape=[2])]
    assert decode_json(b'{"inputs": {"m": [true, false]}}', mask)["m"].dtype == np.bool_
    with pytest.raises(InvalidRequest, match=r"expected booleans \(true/false\); given values"):
        decode_json(b'{"inputs": {"m": [1, 0]}}', mask)
    floats = [TensorSpec(name="x", dtype="float16", shape=[2])]
    assert decode_json(b'{"inputs": {"x": [1, 2.5]}}', floats)["x"].dtype == np.float16
    assert decode_json(b'{"inputs": {"x": []}}', floats)["x"].shape == (0,)


def test_non_finite_outputs_are_still_json(client) -> None:
    x = np.full((1, 64), np.inf, np.float32)
    response = client.post("/v1/models/mlp/infer", content=npz(x=x),
                           headers={"Content-Type": NPZ})
    assert response.status_code == 200
    assert "NaN" in response.text or "Infinity" in response.text


def test_a_streamed_body_over_the_limit_is_413(client) -> None:
    chunks = iter([b'{"inputs": {"x": [' + b"0.5, " * 100_000] * 4)  # no Content-Length
    response = client.post("/v1/models/mlp/infer", content=chunks,
                           headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert response.json()["details"] == {"limit_bytes": LIMIT}
    assert response.json()["code"] == "payload_too_large"


def test_a_token_guards_every_route_but_healthz(table) -> None:
    guarded = TestClient(create_app(table, max_body_bytes=LIMIT, registry=None, token="s3cret"))
    assert guarded.get("/healthz").status_code == 200  # probes need no token
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        for method, path in (("post", "/v1/models/mlp/infer"), ("get", "/v1/models"),
                             ("get", "/metrics")):
            response = getattr(guarded, method)(path, headers=headers,
                                                **({"json": {"inputs": {"x": X.tolist()}}}
                                                   if method == "post" else {}))
            assert response.status_code == 401, (path, headers)
            assert response.json()["code"] == "unauthenticated"
            assert response.headers["www-authenticate"] == "Bearer"
    ok = guarded.post("/v1/models/mlp/infer", json={"inputs": {"x": X.tolist()}},
                      headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200, ok.text
    assert guarded.get("/metrics", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_json_over_its_own_limit_is_413_before_parsing(table) -> None:
    small = TestClient(create_app(table, max_body_bytes=LIMIT, max_json_bytes=1000))
    response = small.post("/v1/models/mlp/infer", json={"inputs": {"x": X.tolist()}})
    assert response.status_code == 413, response.text
    assert "KILN_AGENT_MAX_JSON_BYTES" in response.json()["message"]
    # The same tensor as npz is within the body limit and runs.
    ok = small.post("/v1/models/mlp/infer", content=npz(x=X), headers={"Content-Type": NPZ})
    assert ok.status_code == 200, ok.text


def test_json_depth_is_measured_outside_strings() -> None:
    from runtime_agent.bounded import json_depth

    assert json_depth(b'{"a": [[1, 2], [3]]}') == 3
    assert json_depth(b'{"a": "[[[[[[", "b": [1]}') == 2
    assert json_depth(b'{"a\\": "]]]\\"[", "b": "x\\"]]"}') == 1
    assert json_depth(b"") == 0

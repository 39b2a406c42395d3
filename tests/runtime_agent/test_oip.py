"""The Open Inference Protocol on the agent: REST through FastAPI's TestClient and gRPC through
its generated stub, on a real compiled artifact, against onnxruntime.

tritonclient itself talks to a real agent process in ``tests/integration/test_oip.py``; its
gRPC module cannot be imported here, beside the server's own generated code (both define the
protocol's ``inference.*`` messages in protobuf's one default pool).
"""

from __future__ import annotations

import json
import re

import grpc
import numpy as np
import pytest
from fastapi.testclient import TestClient
from prometheus_client import generate_latest

from runtime_agent.artifact_dir import load_artifact
from runtime_agent.grpc_server import GrpcServer
from runtime_agent.inference import Metrics
from runtime_agent.protocol import grpc_predict_v2_pb2 as pb
from runtime_agent.protocol import grpc_predict_v2_pb2_grpc as pb_grpc
from runtime_agent.server import create_app
from runtime_agent.serving import ModelTable, ServedModel
from tests.runtime_agent.helpers import Fixtures

LIMIT = 1 << 20
X = np.random.default_rng(5).standard_normal((3, 64)).astype(np.float32)
HEADER = "Inference-Header-Content-Length"


@pytest.fixture(scope="module")
def table(built: Fixtures) -> ModelTable:
    models = ModelTable()
    models.put(ServedModel("mlp", load_artifact(built.mlp_a)))
    return models


@pytest.fixture
def client(table: ModelTable) -> TestClient:
    return TestClient(create_app(table, max_body_bytes=LIMIT))


@pytest.fixture(scope="module")
def expected(built: Fixtures) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(built.mlp_a / "engine.onnx"),
                                   providers=["CPUExecutionProvider"])
    return session.run(None, {"x": X})[0]


def tensor(x: np.ndarray = X, **extra) -> dict:
    return {"name": "x", "datatype": "FP32", "shape": list(x.shape), **extra}


def binary_body(header: dict, *chunks: bytes) -> tuple[bytes, dict[str, str]]:
    text = json.dumps(header).encode()
    return text + b"".join(chunks), {HEADER: str(len(text)),
                                     "Content-Type": "application/octet-stream"}


def split(response) -> tuple[dict, bytes]:
    length = int(response.headers[HEADER])
    return json.loads(response.content[:length]), response.content[length:]


# ---------------------------------------------------------------- REST
def test_health_metadata_ready_and_index(client, table) -> None:
    artifact = table.get("mlp").artifact_id
    assert client.get("/v2/health/live").status_code == 200
    assert client.get("/v2/health/ready").status_code == 200
    assert client.get("/v2").json()["extensions"] == ["binary_tensor_data", "model_repository"]
    metadata = client.get("/v2/models/mlp").json()
    assert metadata == {
        "name": "mlp", "versions": [artifact], "platform": "onnxruntime_onnx",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 64]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 16]}],
    }
    assert client.get(f"/v2/models/mlp/versions/{artifact}").json() == metadata
    assert client.get("/v2/models/mlp/ready").status_code == 200
    assert client.get(f"/v2/models/mlp/versions/{artifact}/ready").status_code == 200
    assert client.post("/v2/repository/index").json() == [
        {"name": "mlp", "version": artifact, "state": "READY", "reason": ""}]
    empty = TestClient(create_app(ModelTable()))
    assert empty.get("/v2/health/live").status_code == 200
    assert empty.get("/v2/health/ready").status_code == 400  # nothing to infer with


def test_json_infer_matches_onnxruntime(client, table, expected) -> None:
    response = client.post("/v2/models/mlp/infer", json={
        "id": "r1", "inputs": [tensor(data=X.reshape(-1).tolist())]})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"] == "r1" and body["model_version"] == table.get("mlp").artifact_id
    [y] = body["outputs"]
    assert (y["name"], y["datatype"], y["shape"]) == ("y", "FP32", [3, 16])
    np.testing.assert_allclose(np.asarray(y["data"], np.float32).reshape(3, 16), expected,
                               rtol=1e-6, atol=1e-6)
    nested = client.post("/v2/models/mlp/infer", json={"inputs": [tensor(data=X.tolist())]})
    assert nested.status_code == 200 and nested.json()["outputs"][0]["shape"] == [3, 16]


def test_binary_infer_both_ways(client, expected) -> None:
    body, headers = binary_body(
        {"inputs": [tensor(parameters={"binary_data_size": X.nbytes})],
         "parameters": {"binary_data_output": True}}, X.tobytes())
    response = client.post("/v2/models/mlp/infer", content=body, headers=headers)
    assert response.status_code == 200, response.text
    header, data = split(response)
    [y] = header["outputs"]
    assert y["parameters"] == {"binary_data_size": expected.nbytes} and "data" not in y
    np.testing.assert_array_equal(np.frombuffer(data, np.float32).reshape(3, 16), expected)
    # Binary input, JSON output when the output asks for it.
    body, headers = binary_body(
        {"inputs": [tensor(parameters={"binary_data_size": X.nbytes})],
         "outputs": [{"name": "y", "parameters": {"binary_data": False}}]}, X.tobytes())
    response = client.post("/v2/models/mlp/infer", content=body, headers=headers)
    assert response.status_code == 200 and HEADER not in response.headers
    np.testing.assert_array_equal(
        np.asarray(response.json()["outputs"][0]["data"], np.float32).reshape(3, 16), expected)


def _bin(header: dict, *chunks: bytes, length: int | None = None) -> tuple[bytes, dict]:
    body, headers = binary_body(header, *chunks)
    if length is not None:
        headers[HEADER] = str(length)
    return body, headers


X1 = X[:1]
BIN = {"binary_data_size": X1.nbytes}
def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


BAD = [
    # (name, body, headers, status, message)
    ("wrong datatype", {"inputs": [tensor(X1, datatype="FP64", data=[0.0] * 64)]}, None, 400,
     r"input 'x': expected datatype FP32 \(x: FP32\[-1, 64\]\); given 'FP64'"),
    ("unknown datatype", {"inputs": [tensor(X1, datatype="FLOAT", data=[0.0] * 64)]}, None,
     400, "expected datatype FP32"),
    ("wrong shape", {"inputs": [tensor(X1, shape=[1, 63], data=[0.0] * 63)]}, None, 400,
     r"expected shape \[-1, 64\] \(-1: any size"),
    ("wrong rank", {"inputs": [tensor(X1, shape=[64], data=[0.0] * 64)]}, None, 400,
     r"expected shape \[-1, 64\]"),
    ("negative dimension", {"inputs": [tensor(X1, shape=[-1, 64], data=[0.0] * 64)]}, None,
     400, "non-negative integers"),
    ("unknown input", {"inputs": [{**tensor(X1), "name": "z", "data": [0.0] * 64}]}, None,
     400, r"model 'mlp' has no input 'z'; its inputs are \[x: FP32\[-1, 64\]\]"),
    ("missing input", {"inputs": []}, None, 400, r"missing \['x'\]"),
    ("duplicate input", {"inputs": [tensor(X1, data=[0.0] * 64)] * 2}, None, 400,
     "named once"),
    ("count mismatch", {"inputs": [tensor(X1, data=[0.0] * 60)]}, None, 400,
     r"shape \[1, 64\] holds 64 elements; given 60"),
    ("strings", {"inputs": [tensor(X1, data=["a"] * 64)]}, None, 400,
     "expected numbers; given strings"),
    ("no data", {"inputs": [tensor(X1)]}, None, 400, "expected 'data' or"),
    ("not the protocol", {"inputs": {"x": [[1.0] * 64]}}, None, 400,
     r'expected a JSON object \{"inputs": \['),
    ("unknown output", {"inputs": [tensor(X1, data=[0.0] * 64)], "outputs": [{"name": "q"}]},
     None, 400, r"no output\(s\) \['q'\]; its outputs are \['y'\]"),
    ("binary too short", *_bin({"inputs": [tensor(X1, parameters=BIN)]}, X1.tobytes()[:-4]),
     400, "runs past the body's 252 remaining binary bytes"),
    ("binary size wrong", *_bin({"inputs": [tensor(X1, parameters={"binary_data_size": 8})]},
                                X1.tobytes()[:8]), 400,
     r"FP32\[1, 64\] takes 256 bytes; given 8"),
    ("binary left over", *_bin({"inputs": [tensor(X1, parameters=BIN)]}, X1.tobytes(), b"xx"),
     400, "2 bytes of binary data that no input"),
    ("header length too big", *_bin({"inputs": [tensor(X1, parameters=BIN)]}, X1.tobytes(),
                                    length=100_000), 400,
     "Inference-Header-Content-Length is 100000"),
    ("header length not a number", b'{"inputs": []}', {HEADER: "ten"}, 400,
     "must be a byte count"),
    ("malformed JSON", b'{"inputs": [', None, 400, "not valid JSON"),
    ("too large", {"inputs": [tensor(X1, shape=[20_000, 64], data=[[0.5] * 64] * 20_000)]},
     None, 413, f"over the limit of {LIMIT} bytes"),
    ("deep nesting", b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 64], '
     b'"data": ' + b"[" * 50_000 + b"]" * 50_000 + b"}]}", None, 400,
     "JSON header nests 50003 levels deep; at most 64"),
    ("deep nesting in the binary header", *_bin({"inputs": [tensor(X1, parameters=BIN)],
                                                 "id": _nested(70)}, X1.tobytes()),
     400, "nests 71 levels deep"),
]


@pytest.mark.parametrize(("body", "headers", "status", "message"),
                         [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_input_is_a_protocol_error(client, body, headers, status, message) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = client.post("/v2/models/mlp/infer", content=data,
                           headers=headers or {"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()
    assert list(error) == ["error"]
    assert re.search(message, error["error"]), error["error"]
    # ... and the server keeps serving.
    ok = client.post("/v2/models/mlp/infer", json={"inputs": [tensor(X1, data=[0.5] * 64)]})
    assert ok.status_code == 200, ok.text


def test_missing_model_or_version_is_404(client) -> None:
    for path in ("/v2/models/resnet", "/v2/models/resnet/ready", "/v2/models/mlp/versions/7",
                 "/v2/models/mlp/versions/7/ready"):
        response = client.get(path)
        assert response.status_code == 404, path
    response = client.post("/v2/models/resnet/infer", json={"inputs": []})
    assert response.json() == {"error": "no model named 'resnet' is loaded on this agent; "
                                        "loaded models are ['mlp']"}
    response = client.post("/v2/models/mlp/versions/7/infer", json={"inputs": []})
    assert response.status_code == 404
    assert re.match(r"model 'mlp' has no version '7'; its one version is '[0-9a-f]{32}'",
                    response.json()["error"])
    assert "error" in client.get("/v2/nothing").json()


def test_compressed_body_is_refused(client) -> None:
    response = client.post("/v2/models/mlp/infer", content=b"\x1f\x8b",
                           headers={"Content-Encoding": "gzip"})
    assert response.status_code == 400
    assert "unsupported Content-Encoding 'gzip'" in response.json()["error"]


def test_token_guards_v2_but_not_its_probes(table) -> None:
    guarded = TestClient(create_app(table, token="s3cret"))
    assert guarded.get("/v2/health/live").status_code == 200
    assert guarded.get("/v2/health/ready").status_code == 200
    for method, path in (("get", "/v2/models/mlp"), ("get", "/v2/models/mlp/ready"),
                         ("post", "/v2/models/mlp/infer"), ("post", "/v2/repository/index"),
                         ("get", "/v2")):
        response = getattr(guarded, method)(path, headers={"Authorization": "Bearer nope"})
        assert response.status_code == 401, path
        assert "KILN_AGENT_SERVE_TOKEN" in response.json()["error"]
    ok = guarded.post("/v2/models/mlp/infer", headers={"Authorization": "Bearer s3cret"},
                      json={"inputs": [tensor(X1, data=[0.5] * 64)]})
    assert ok.status_code == 200


def test_triton_metrics_count_every_transport(built: Fixtures) -> None:
    table = ModelTable()
    model = ServedModel("mlp", load_artifact(built.mlp_b))
    table.put(model)
    client = TestClient(create_app(table))
    for _ in range(2):
        assert client.post("/v2/models/mlp/infer",
                           json={"inputs": [tensor(data=X.reshape(-1).tolist())]}).is_success
    assert client.post("/v1/models/mlp/infer", json={"inputs": {"x": X1.tolist()}}).is_success
    assert client.post("/v2/models/mlp/infer", json={"inputs": []}).status_code == 400
    text = client.get("/metrics").text
    labels = f'model="mlp",version="{model.artifact_id}"'
    assert "# TYPE nv_inference_request_success untyped" in text
    assert f"nv_inference_request_success{{{labels}}} 3.0" in text
    assert (f'nv_inference_request_failure{{model="mlp",reason="invalid_request",'
            f'version="{model.artifact_id}"}} 1.0') in text
    assert f"nv_inference_count{{{labels}}} 7.0" in text  # 3 + 3 + 1 rows
    assert f"nv_inference_exec_count{{{labels}}} 3.0" in text
    duration = float(re.search(rf"nv_inference_request_duration_us{{{labels}}} (\S+)",
                               text).group(1))
    compute = float(re.search(rf"nv_inference_compute_infer_duration_us{{{labels}}} (\S+)",
                              text).group(1))
    assert 0 < compute <= duration
    assert model.stats.count == 4 and model.stats.errors == 1


# ---------------------------------------------------------------- gRPC
@pytest.fixture
def grpc_stub(table: ModelTable):
    server = GrpcServer(table, Metrics(table), "127.0.0.1", 0, token="s3cret",
                        max_message_bytes=LIMIT, workers=2)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield pb_grpc.GRPCInferenceServiceStub(channel)
    finally:
        channel.close()
        server.stop()


AUTH = (("authorization", "Bearer s3cret"),)


def raw_request(x: np.ndarray = X, **overrides) -> pb.ModelInferRequest:
    fields = {"model_name": "mlp", "inputs": [pb.ModelInferRequest.InferInputTensor(
        name="x", datatype="FP32", shape=list(x.shape))], "raw_input_contents": [x.tobytes()]}
    return pb.ModelInferRequest(**{**fields, **overrides})


def test_grpc_metadata_and_infer_match_onnxruntime(grpc_stub, table, expected) -> None:
    assert grpc_stub.ServerLive(pb.ServerLiveRequest()).live  # probes need no token
    assert grpc_stub.ServerReady(pb.ServerReadyRequest()).ready
    metadata = grpc_stub.ModelMetadata(pb.ModelMetadataRequest(name="mlp"), metadata=AUTH)
    assert metadata.platform == "onnxruntime_onnx"
    assert list(metadata.versions) == [table.get("mlp").artifact_id]
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == [
        ("x", "FP32", [-1, 64])]
    assert grpc_stub.ModelReady(pb.ModelReadyRequest(name="mlp"), metadata=AUTH).ready
    assert not grpc_stub.ModelReady(pb.ModelReadyRequest(name="nope"), metadata=AUTH).ready

    answer = grpc_stub.ModelInfer(raw_request(id="g1"), metadata=AUTH)
    assert answer.id == "g1" and [o.name for o in answer.outputs] == ["y"]
    assert list(answer.outputs[0].shape) == [3, 16]
    np.testing.assert_array_equal(
        np.frombuffer(answer.raw_output_contents[0], np.float32).reshape(3, 16), expected)
    typed = pb.ModelInferRequest(model_name="mlp", inputs=[
        pb.ModelInferRequest.InferInputTensor(
            name="x", datatype="FP32", shape=[3, 64],
            contents=pb.InferTensorContents(fp32_contents=X.reshape(-1).tolist()))])
    answer = grpc_stub.ModelInfer(typed, metadata=AUTH)
    np.testing.assert_array_equal(
        np.frombuffer(answer.raw_output_contents[0], np.float32).reshape(3, 16), expected)


def _tensor(**fields) -> pb.ModelInferRequest.InferInputTensor:
    return pb.ModelInferRequest.InferInputTensor(**{"name": "x", "datatype": "FP32",
                                                    "shape": [1, 64], **fields})


GRPC_BAD = [
    ("wrong datatype", raw_request(X1, inputs=[_tensor(datatype="FP64")]),
     grpc.StatusCode.INVALID_ARGUMENT, "expected datatype FP32"),
    ("wrong shape", raw_request(X1, inputs=[_tensor(shape=[1, 32])]),
     grpc.StatusCode.INVALID_ARGUMENT, r"expected shape \[-1, 64\]"),
    ("unknown input", raw_request(X1, inputs=[_tensor(name="z")]),
     grpc.StatusCode.INVALID_ARGUMENT, "has no input 'z'"),
    ("raw length", raw_request(X1, raw_input_contents=[b"\0" * 12]),
     grpc.StatusCode.INVALID_ARGUMENT, r"takes 256 bytes; given 12"),
    ("raw count", raw_request(X1, raw_input_contents=[X1.tobytes()] * 2),
     grpc.StatusCode.INVALID_ARGUMENT, "raw_input_contents has 2 entries"),
    ("FP16 typed", raw_request(X1, inputs=[_tensor(datatype="FP16")], raw_input_contents=[]),
     grpc.StatusCode.INVALID_ARGUMENT, "has no typed contents field; send it in raw"),
    ("typed count", raw_request(X1, raw_input_contents=[], inputs=[_tensor(
        contents=pb.InferTensorContents(fp32_contents=[1.0] * 3))]),
     grpc.StatusCode.INVALID_ARGUMENT, "holds 64 elements; given 3"),
    ("unknown output", raw_request(X1, outputs=[
        pb.ModelInferRequest.InferRequestedOutputTensor(name="q")]),
     grpc.StatusCode.INVALID_ARGUMENT, r"no output\(s\) \['q'\]"),
    ("missing model", raw_request(X1, model_name="resnet"), grpc.StatusCode.NOT_FOUND,
     "no model named 'resnet'"),
    ("missing version", raw_request(X1, model_version="3"), grpc.StatusCode.NOT_FOUND,
     "has no version '3'"),
    ("too large", raw_request(np.zeros((5000, 64), np.float32)),
     grpc.StatusCode.RESOURCE_EXHAUSTED, None),
]


@pytest.mark.parametrize(("request_", "status", "message"), [c[1:] for c in GRPC_BAD],
                         ids=[c[0] for c in GRPC_BAD])
def test_grpc_bad_input_is_a_status(grpc_stub, request_, status, message) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        grpc_stub.ModelInfer(request_, metadata=AUTH)
    assert caught.value.code() is status, caught.value.details()
    if message is not None:
        assert re.search(message, caught.value.details()), caught.value.details()
    assert grpc_stub.ModelInfer(raw_request(X1), metadata=AUTH).outputs[0].shape == [1, 16]


def test_grpc_needs_the_token(grpc_stub) -> None:
    for metadata in ((), (("authorization", "Bearer nope"),)):
        with pytest.raises(grpc.RpcError) as caught:
            grpc_stub.ModelInfer(raw_request(X1), metadata=metadata)
        assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError):
            grpc_stub.ModelMetadata(pb.ModelMetadataRequest(name="mlp"), metadata=metadata)


def test_a_swapped_engine_is_checked_and_counted_as_itself(built: Fixtures, tmp_path) -> None:
    """What the servers work out once per engine (its inputs' checks, its metric series) is
    the new engine's after a swap under the same name: its signature, its version."""
    from compiler_worker.pipeline import compile_model, write_artifact_dir
    from kiln.examples import mlp
    from runtime_agent.fingerprint import detect_fingerprint
    from tests.runtime_agent.helpers import FAST

    result = compile_model(mlp(in_features=8, batch=2).SerializeToString(), FAST,
                           fingerprint=detect_fingerprint(), workdir=tmp_path / "work")
    narrow = load_artifact(write_artifact_dir(result, tmp_path / "out"))
    table = ModelTable()
    wide = ServedModel("mlp", load_artifact(built.mlp_a))
    table.put(wide)
    metrics = Metrics(table)
    server = GrpcServer(table, metrics, "127.0.0.1", 0, workers=2)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        assert stub.ModelInfer(raw_request(X1)).model_version == wide.artifact_id
        table.put(ServedModel("mlp", narrow))
        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfer(raw_request(X1))  # the old engine's shape
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "expected shape [2, 8]" in refused.value.details()
        x = np.ones((2, 8), np.float32)
        answer = stub.ModelInfer(raw_request(x))
        assert answer.model_version == narrow.manifest.artifact_id
        assert list(answer.outputs[0].shape) == [2, 16]
    finally:
        channel.close()
        server.stop()
    text = generate_latest(metrics.registry).decode()
    for version, count in ((wide.artifact_id, 1), (narrow.manifest.artifact_id, 1)):
        assert f'nv_inference_request_success{{model="mlp",version="{version}"}} ' \
               f'{count:.1f}' in text
        assert f'kiln_agent_requests_total{{artifact="{version}",model="mlp",outcome="ok"}} ' \
               f'{count:.1f}' in text

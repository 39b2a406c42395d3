"""The Open Inference Protocol on a real agent process: unmodified tritonclient (HTTP in this
process, gRPC in a child process) lists, inspects and infers, against onnxruntime."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kiln.examples import mlp
from tests.conftest import free_port
from tests.integration.agents import AgentProcess, reference
from tests.integration.conftest import UNTUNED

pytestmark = pytest.mark.integration

TOKEN = "serve-s3cret"
X = {"x": np.random.default_rng(4).normal(size=(5, 64)).astype(np.float32)}


@pytest.fixture
def agents() -> Iterator[list[AgentProcess]]:
    started: list[AgentProcess] = []
    yield started
    for agent in started:
        agent.kill()


# tritonclient.http adds Inference-Header-Content-Length to the headers dict it is given (it
# mutates the caller's dict), so every call gets a fresh copy of the token headers.
def test_tritonclient_http_and_grpc_against_an_agent(stack, agents, tmp_path):
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    model = mlp(seed=3).SerializeToString()
    client = stack.client()
    client.deploy("mlp", client.upload_model(model, name="mlp").id, selector={"site": "a"},
                  options=UNTUNED)
    grpc_port = free_port()
    agent = AgentProcess(stack, "n1", "site=a", tmp_path).start(env={
        "KILN_AGENT_SERVE_TOKEN": TOKEN, "KILN_AGENT_GRPC_PORT": str(grpc_port)})
    agents.append(agent)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    client = httpclient.InferenceServerClient(f"127.0.0.1:{agent.port}")
    deadline = time.monotonic() + 120
    while True:
        assert agent.proc is not None and agent.proc.poll() is None, agent.log.read_text()
        try:
            if client.is_model_ready("mlp", headers=dict(auth)):
                break
        except (InferenceServerException, ConnectionError, OSError):
            pass
        assert time.monotonic() < deadline, agent.log.read_text()[-3000:]
        time.sleep(0.3)
    want = reference(model, X)["y"]

    # HTTP: list, inspect, infer (binary both ways, then JSON).
    assert client.is_server_live() and client.is_server_ready()
    [listed] = client.get_model_repository_index(headers=dict(auth))
    assert listed["name"] == "mlp" and listed["state"] == "READY"
    metadata = client.get_model_metadata("mlp", headers=dict(auth))
    assert metadata["versions"] == [listed["version"]]
    assert metadata["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 64]}]
    assert metadata["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [-1, 16]}]
    x = httpclient.InferInput("x", [5, 64], "FP32")
    x.set_data_from_numpy(X["x"])
    result = client.infer("mlp", [x], headers=dict(auth))
    np.testing.assert_allclose(result.as_numpy("y"), want, rtol=1e-4, atol=1e-5)
    as_json = httpclient.InferInput("x", [5, 64], "FP32")
    as_json.set_data_from_numpy(X["x"], binary_data=False)
    result = client.infer("mlp", [as_json], headers=dict(auth), model_version=listed["version"],
                          outputs=[httpclient.InferRequestedOutput("y", binary_data=False)])
    np.testing.assert_allclose(result.as_numpy("y"), want, rtol=1e-4, atol=1e-5)
    with pytest.raises(InferenceServerException, match="expected datatype FP32"):
        wrong = httpclient.InferInput("x", [1, 64], "FP64")
        wrong.set_data_from_numpy(np.zeros((1, 64), np.float64))
        client.infer("mlp", [wrong], headers=dict(auth))
    with pytest.raises(InferenceServerException, match="KILN_AGENT_SERVE_TOKEN"):
        client.infer("mlp", [x])
    with pytest.raises(InferenceServerException, match="no model named 'resnet'"):
        client.get_model_metadata("resnet", headers=dict(auth))
    np.testing.assert_allclose(client.infer("mlp", [x], headers=dict(auth)).as_numpy("y"), want,
                               rtol=1e-4, atol=1e-5)

    # gRPC, on its own port, with the same token.
    np.savez(tmp_path / "in.npz", **X)
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("triton_grpc_client.py")),
         f"127.0.0.1:{grpc_port}", TOKEN, "mlp", str(tmp_path / "in.npz"),
         str(tmp_path / "out.npz")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["live"] and report["ready"] and report["model_ready"]
    assert report["metadata"]["platform"] == "onnxruntime_onnx"
    assert report["metadata"]["inputs"] == [{"name": "x", "datatype": "FP32",
                                             "shape": ["-1", "64"]}]  # int64 as JSON strings
    with np.load(tmp_path / "out.npz") as out:
        np.testing.assert_allclose(out["y"], want, rtol=1e-4, atol=1e-5)
    errors = report["errors"]
    assert errors["datatype"]["status"] == "StatusCode.INVALID_ARGUMENT"
    assert "expected datatype FP32" in errors["datatype"]["message"]
    assert errors["model"]["status"] == "StatusCode.NOT_FOUND"
    assert errors["token"]["status"] == "StatusCode.UNAUTHENTICATED"
    assert report["after_errors"] == [5, 16]

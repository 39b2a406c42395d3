"""Dynamic batching on the agent, on a real compiled artifact and onnxruntime: concurrent
requests stacked into shared engine calls get their own rows; an oversized or malformed
request fails alone; Triton's config and statistics over REST and gRPC."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest
from fastapi.testclient import TestClient

from runtime_agent import inference
from runtime_agent.artifact_dir import load_artifact
from runtime_agent.grpc_server import GrpcServer
from runtime_agent.inference import Metrics
from runtime_agent.protocol import grpc_predict_v2_pb2 as pb
from runtime_agent.protocol import grpc_predict_v2_pb2_grpc as pb_grpc
from runtime_agent.server import create_app
from runtime_agent.serving import ModelTable, ServedModel
from schemas.deployments import BatchingPolicy
from schemas.errors import InvalidRequest
from tests.runtime_agent.helpers import Fixtures

CLIENTS = 12
POLICY = BatchingPolicy(max_batch_size=8, max_queue_delay_us=50_000,
                        preferred_batch_sizes=[8], instances=1)


@pytest.fixture(scope="module")
def executor(built: Fixtures):
    return load_artifact(built.mlp_a)


def _feeds() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.standard_normal((1 + i % 3, 64)).astype(np.float32) for i in range(CLIENTS)]


def _concurrently(model: ServedModel, feeds: list) -> list:
    results: list = [None] * len(feeds)
    barrier = threading.Barrier(len(feeds))

    def client(i: int) -> None:
        barrier.wait()
        try:
            results[i] = inference.run(model, lambda: {"x": feeds[i]}, METRICS)
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(feeds))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return results


METRICS = Metrics(ModelTable())


def test_concurrent_requests_share_engine_calls_and_get_their_own_rows(executor) -> None:
    model = ServedModel("mlp", executor, batching=POLICY)
    assert model.batcher is not None
    feeds = _feeds()
    want = [executor.run({"x": x})["y"] for x in feeds]
    results = _concurrently(model, feeds)
    for x, got, expected in zip(feeds, results, want, strict=True):
        assert got["y"].shape == (x.shape[0], 16)
        np.testing.assert_allclose(got["y"], expected, rtol=1e-5, atol=1e-6)
    stats = model.infer_stats.snapshot()
    assert stats["success"][0] == CLIENTS
    assert stats["inference_count"] == sum(x.shape[0] for x in feeds)
    # Gathered: fewer engine calls than requests, none above the maximum.
    assert stats["execution_count"] < CLIENTS
    assert max(stats["batches"]) <= POLICY.max_batch_size and max(stats["batches"]) > 3


def test_an_oversized_or_malformed_request_fails_alone(executor) -> None:
    model = ServedModel("mlp", executor, batching=POLICY)
    feeds: list = _feeds()
    feeds[3] = np.zeros((9, 64), np.float32)  # above max_batch_size
    feeds[5] = np.zeros((2, 63), np.float32)  # not the signature's shape
    results = _concurrently(model, feeds)
    assert isinstance(results[3], InvalidRequest) and "max_batch_size=8" in str(results[3])
    assert isinstance(results[5], InvalidRequest)
    for i, x in enumerate(feeds):
        if i not in (3, 5):
            np.testing.assert_allclose(results[i]["y"], executor.run({"x": x})["y"],
                                       rtol=1e-5, atol=1e-6)
    assert model.infer_stats.snapshot()["fail"][0] == 2


def test_a_lone_request_runs_in_its_own_thread_at_once(executor, monkeypatch) -> None:
    model = ServedModel("mlp", executor, batching=POLICY.model_copy(
        update={"max_queue_delay_us": 0}))
    ran_in: list = []
    original = executor.run
    monkeypatch.setattr(executor, "run",
                        lambda feed: ran_in.append(threading.get_ident()) or original(feed))
    outputs = inference.run(model, lambda: {"x": np.ones((2, 64), np.float32)}, METRICS)
    assert outputs["y"].shape == (2, 16) and ran_in == [threading.get_ident()]


def test_a_static_batch_axis_serves_unbatched(built: Fixtures, executor) -> None:
    static = executor.manifest.model_copy(deep=True)
    static.inputs[0].shape[0] = 3
    shim = type("Static", (), {"manifest": static})()
    from runtime_agent.batching import batchable

    assert batchable(executor) and not batchable(shim)


# ---------------------------------------------------------------- config and stats
@pytest.fixture
def table(executor) -> ModelTable:
    models = ModelTable()
    models.put(ServedModel("mlp", executor, batching=POLICY.model_copy(
        update={"instances": 2, "preferred_batch_sizes": [4, 8]})))
    models.put(ServedModel("plain", executor))
    return models


def test_config_and_stats_over_rest(table) -> None:
    client = TestClient(create_app(table))
    artifact = table.get("mlp").artifact_id
    config = client.get("/v2/models/mlp/config").json()
    assert config["max_batch_size"] == 8 and config["platform"] == "onnxruntime_onnx"
    assert config["input"][0] | {"name": "x", "data_type": "TYPE_FP32", "dims": [64]} == \
        config["input"][0]
    assert config["output"][0]["dims"] == [16]
    assert config["dynamic_batching"] == {"preferred_batch_size": [4, 8],
                                          "max_queue_delay_microseconds": 50_000,
                                          "preserve_ordering": False}
    assert config["instance_group"] == [{"name": "mlp", "kind": "KIND_CPU", "count": 2}]
    assert client.get(f"/v2/models/mlp/versions/{artifact}/config").json() == config
    plain = client.get("/v2/models/plain/config").json()
    assert plain["max_batch_size"] == 0 and plain["input"][0]["dims"] == [-1, 64]
    assert "dynamic_batching" not in plain
    assert client.get("/v2/models/nope/config").status_code == 404

    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [3, 64],
                        "data": [0.5] * 192}]}
    assert client.post("/v2/models/mlp/infer", json=body).status_code == 200
    assert client.post("/v2/models/mlp/infer", json={**body, "inputs": [
        {**body["inputs"][0], "shape": [9, 64], "data": [0.5] * 576}]}).status_code == 400
    [stats] = client.get("/v2/models/mlp/stats").json()["model_stats"]
    assert (stats["name"], stats["version"]) == ("mlp", "1")
    assert (stats["inference_count"], stats["execution_count"]) == (3, 1)
    infer = stats["inference_stats"]
    assert infer["success"]["count"] == 1 and infer["success"]["ns"] > 0
    assert infer["fail"]["count"] == 1 and infer["compute_infer"]["ns"] > 0
    assert stats["batch_stats"][0]["batch_size"] == 3
    assert [s["name"] for s in client.get("/v2/models/stats").json()["model_stats"]] == [
        "mlp", "plain"]
    assert client.get(f"/v2/models/mlp/versions/{artifact}/stats").status_code == 200
    assert client.get("/v2/models/mlp/versions/other/stats").status_code == 404


def test_config_and_stats_over_grpc(table) -> None:
    server = GrpcServer(table, Metrics(table), "127.0.0.1", 0, workers=2)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        config = stub.ModelConfig(pb.ModelConfigRequest(name="mlp")).config
        assert (config.max_batch_size, list(config.input[0].dims)) == (8, [64])
        assert config.input[0].data_type == pb.TYPE_FP32
        assert list(config.dynamic_batching.preferred_batch_size) == [4, 8]
        assert config.instance_group[0].count == 2
        x = np.ones((2, 64), np.float32)
        stub.ModelInfer(pb.ModelInferRequest(
            model_name="mlp", inputs=[pb.ModelInferRequest.InferInputTensor(
                name="x", datatype="FP32", shape=[2, 64])], raw_input_contents=[x.tobytes()]))
        [stats] = stub.ModelStatistics(pb.ModelStatisticsRequest(name="mlp")).model_stats
        assert (stats.inference_count, stats.execution_count) == (2, 1)
        assert stats.inference_stats.success.count == 1
        with pytest.raises(grpc.RpcError) as missing:
            stub.ModelConfig(pb.ModelConfigRequest(name="nope"))
        assert missing.value.code() is grpc.StatusCode.NOT_FOUND
    finally:
        channel.close()
        server.stop()


def test_the_agent_serves_the_desired_policy_and_follows_its_change(
        tmp_path, control_plane, built: Fixtures) -> None:
    from runtime_agent.agent import Agent
    from runtime_agent.config import AgentSettings
    from tests.runtime_agent.helpers import TOKEN, desired_model, free_port, wait_for

    settings = AgentSettings(
        api_url=control_plane.url, token=TOKEN, name="node-1", labels={"zone": "a"},
        cache_dir=tmp_path / "cache", serve_port=free_port(),
        trusted_keys=[built.keys.public], heartbeat_s=0.05, request_timeout_s=5)
    artifact = control_plane.add(built.mlp_a)
    control_plane.desired = [desired_model("mlp", artifact).model_copy(
        update={"batching": POLICY})]
    with Agent(settings) as agent:
        wait_for(lambda: agent.models.find("mlp") is not None, what="serving")
        first = agent.models.get("mlp")
        assert first.batching == POLICY and first.batcher is not None
        changed = POLICY.model_copy(update={"max_queue_delay_us": 0, "instances": 3})
        control_plane.desired = [desired_model("mlp", artifact).model_copy(
            update={"batching": changed})]
        wait_for(lambda: agent.models.get("mlp").batching == changed, what="new policy")
        second = agent.models.get("mlp")
        assert second.executor is first.executor and second.infer_stats is first.infer_stats
        control_plane.desired = [desired_model("mlp", artifact)]
        wait_for(lambda: agent.models.get("mlp").batcher is None, what="no batching")

"""Dynamic batching on a real agent process, deployed through the control plane: unmodified
tritonclient reads Triton's config and statistics over HTTP and gRPC, concurrent clients get
their own rows, an oversized request fails alone, and unmodified perf_analyzer runs against
the agent over HTTP and gRPC (where its binary runs on this machine)."""

from __future__ import annotations

import json
import os
import shutil
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

pytestmark = pytest.mark.integration

POLICY = {"max_batch_size": 8, "max_queue_delay_us": 2000, "preferred_batch_sizes": [4, 8],
          "instances": 2}


@pytest.fixture
def agents() -> Iterator[list[AgentProcess]]:
    started: list[AgentProcess] = []
    yield started
    for agent in started:
        agent.kill()


def _perf_analyzer() -> tuple[str, dict[str, str]] | None:
    """The perf_analyzer binary tritonclient installs, with the CUDA runtime library its
    build links (the nvidia-cuda-runtime-cu12 wheel), when it starts here."""
    binary = Path(sys.executable).with_name("perf_analyzer")
    if not binary.is_file():
        found = shutil.which("perf_analyzer")
        if found is None:
            return None
        binary = Path(found)
    env = dict(os.environ)
    libs = list(Path(sys.prefix).glob("lib/python3*/site-packages/nvidia/cuda_runtime/lib"))
    if libs:
        env["LD_LIBRARY_PATH"] = ":".join([str(libs[0]), env.get("LD_LIBRARY_PATH", "")])
    try:
        probe = subprocess.run([str(binary), "--version"], capture_output=True, text=True,
                               env=env, timeout=30, check=False)
    except OSError:
        return None
    return (str(binary), env) if probe.returncode == 0 else None


def test_batching_config_stats_and_perf_analyzer_against_an_agent(stack, agents, tmp_path):
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    model = mlp(seed=5).SerializeToString()
    client = stack.client()
    model_id = client.upload_model(model, name="mlp").id
    applied = client._call("POST", "/v1/deployments", json={
        "name": "mlp", "model_id": model_id, "selector": {"site": "b"},
        "batching": POLICY}).json()
    assert applied["deployment"]["batching"] == POLICY
    grpc_port = free_port()
    agent = AgentProcess(stack, "n1", "site=b", tmp_path).start(
        env={"KILN_AGENT_GRPC_PORT": str(grpc_port)})
    agents.append(agent)
    http = httpclient.InferenceServerClient(f"127.0.0.1:{agent.port}", concurrency=16)
    deadline = time.monotonic() + 120
    while True:
        assert agent.proc is not None and agent.proc.poll() is None, agent.log.read_text()
        try:
            if http.is_model_ready("mlp"):
                break
        except (InferenceServerException, ConnectionError, OSError):
            pass
        assert time.monotonic() < deadline, agent.log.read_text()[-3000:]
        time.sleep(0.3)

    config = http.get_model_config("mlp")
    assert config["max_batch_size"] == 8 and config["input"][0]["dims"] == [64]
    assert config["input"][0]["data_type"] == "TYPE_FP32"
    assert config["dynamic_batching"]["preferred_batch_size"] == [4, 8]
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 2000
    assert config["instance_group"][0]["count"] == 2

    # Concurrent clients, each with its own rows; one oversized request among them.
    rng = np.random.default_rng(9)
    feeds = [rng.standard_normal((1 + i % 3, 64)).astype(np.float32) for i in range(24)]
    feeds[7] = np.zeros((9, 64), np.float32)

    # tritonclient's HTTP client is not thread-safe: its own async_infer keeps up to its
    # ``concurrency`` requests in flight at once.
    pending = []
    for x in feeds:
        tensor = httpclient.InferInput("x", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        pending.append(http.async_infer("mlp", [tensor]))
    answers: list = []
    for request in pending:
        try:
            answers.append(request.get_result().as_numpy("y"))
        except InferenceServerException as exc:
            answers.append(exc)
    assert isinstance(answers[7], InferenceServerException)
    assert "max_batch_size=8" in str(answers[7])
    for i, (x, y) in enumerate(zip(feeds, answers, strict=True)):
        if i != 7:
            np.testing.assert_allclose(y, reference(model, {"x": x})["y"], rtol=1e-4,
                                       atol=1e-5)
    [stats] = http.get_inference_statistics("mlp")["model_stats"]
    assert stats["inference_stats"]["success"]["count"] == 23
    assert stats["inference_stats"]["fail"]["count"] == 1
    assert stats["inference_count"] == sum(x.shape[0] for x in feeds) - 9
    assert 0 < stats["execution_count"] <= 23

    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("triton_grpc_stats.py")),
         f"127.0.0.1:{grpc_port}", "mlp"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["config"]["max_batch_size"] == 8
    assert report["config"]["input"][0]["dims"] == ["64"]  # int64 as JSON strings
    assert report["stats"]["model_stats"][0]["inference_stats"]["success"]["count"] == "23"

    found = _perf_analyzer()
    if found is None:
        pytest.skip("perf_analyzer does not start here (it needs libb64-0d and the CUDA "
                    "runtime library of the nvidia-cuda-runtime-cu12 wheel)")
    binary, env = found
    # This run shows that the unmodified client works against the agent, not a figure: on a
    # host that other tests load, latency moves between windows by more than any stability
    # bound that would mean something, so every window counts as stable.
    for protocol, port in (("http", agent.port), ("grpc", grpc_port)):
        run = subprocess.run(
            [binary, "-m", "mlp", "-u", f"127.0.0.1:{port}", "-i", protocol,
             "--concurrency-range", "4:4", "--measurement-interval", "500",
             "--stability-percentage", "1000", "--max-trials", "6", "--shape", "x:64",
             "-f", str(tmp_path / f"{protocol}.csv")],
            capture_output=True, text=True, env=env, timeout=180, check=False)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
        assert "Inferences/Second" in (tmp_path / f"{protocol}.csv").read_text()

"""A confined agent (``kiln agent`` as a real process, Landlock applied) loads an OpenVINO
engine that the stack's worker built for this machine, and answers an inference with it.

``import openvino`` initialises OpenVINO's telemetry, which reads and writes files under the
home folder; the confinement refuses the real home, and the import used to fail there
(PermissionError), so no OpenVINO engine of any precision loaded in a confined agent. The
agent now has a home of its own beneath its cache holding the telemetry's opt-out
(``runtime_agent.confine.HOME_FILES``); the real home stays refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kiln.examples import mlp
from runtime_agent.confine import HOME_DIRNAME
from runtime_agent.executors import node_fingerprint_keys
from runtime_agent.fingerprint import detect_fingerprint
from schemas.jobs import JobStatus
from schemas.options import CompileOptions, Precision, Tune
from tests.integration.agents import AgentProcess, outputs, reference

pytest.importorskip("openvino")
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

FP32 = CompileOptions(backends=["openvino"], precision=Precision.FP32, tune=Tune.OFF,
                      benchmark_iterations=5)
X = {"x": np.random.default_rng(4).normal(size=(4, 64)).astype(np.float32)}


def test_a_confined_agent_serves_an_openvino_engine(stack, tmp_path: Path) -> None:
    client = stack.client()
    model = mlp(seed=4).SerializeToString()
    model_id = client.upload_model(model, name="ov").id
    key = node_fingerprint_keys(detect_fingerprint())["openvino"]
    (job,) = client.create_jobs(model_id, [key], FP32)
    done = client.wait_job(job.id, timeout_s=300)
    assert done.status is JobStatus.SUCCEEDED, done.error
    assert client.get_manifest(done.artifact_id).backend == "openvino"
    client.deploy("ov", model_id, selector={"engine": "openvino"}, options=FP32)

    agent = AgentProcess(stack, "ov-node", "engine=openvino", tmp_path).start()
    try:
        agent.wait_serving("ov", artifact_id=done.artifact_id, timeout_s=180)
        got = outputs(agent.infer("ov", X))
        want = reference(model, X)
        np.testing.assert_allclose(got["y"], want["y"], rtol=1e-4, atol=1e-5)
    finally:
        agent.kill()
    log = agent.log.read_text()
    assert "agent confined (Landlock" in log, log[-3000:]
    # The telemetry took the opt-out: it made no client id or usage counts in the agent's home.
    home = agent.cache_dir.resolve() / HOME_DIRNAME / "intel"
    assert sorted(p.name for p in home.iterdir()) == ["openvino_telemetry"]

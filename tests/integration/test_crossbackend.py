"""One PyTorch program, two backends, on real processes (the embedded stack: ``kiln api``, a
``kiln worker`` serving an onnxruntime and an AOTInductor key, a ``kiln agent``): both build,
the agent receives the faster verified engine and says why; a program the ONNX exporter
cannot translate fails onnxruntime with ``unsupported_operator`` and still reaches the agent
through AOTInductor."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kiln.stack import EmbeddedStack
from schemas.jobs import JobStatus
from schemas.options import CompileOptions
from tests.integration.agents import AgentProcess, outputs
from tests.integration.conftest import running_stack, wait_for_worker
from tests.models.torch_programs import (
    kthvalue_archive,
    kthvalue_program,
    tiny_mlp,
    tiny_mlp_archive,
)

pytestmark = [pytest.mark.integration, pytest.mark.aotinductor]

OPTIONS = CompileOptions(tune="off")
X = {"x": np.random.default_rng(0).standard_normal((4, 16), dtype=np.float32)}


@pytest.fixture
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[EmbeddedStack]:
    """The embedded stack with a failed build's retry an hour away: what the agent is told of
    a backend whose build failed is that failure, not a retry the planner queued because the
    cold AOTInductor build outlasted the default backoff."""
    yield from running_stack(request, tmp_path, overrides={"KILN_BUILD_RETRY_BASE_S": "3600"})


@pytest.fixture
def agents(stack: EmbeddedStack) -> Iterator[list[AgentProcess]]:
    started: list[AgentProcess] = []
    yield started
    for agent in started:
        agent.kill()


def submit(stack: EmbeddedStack, model: Path) -> subprocess.CompletedProcess:
    """``kiln submit MODEL --tune off --wait``: a job for every live key that builds it."""
    env = {**os.environ, "KILN_HOME": str(stack.home), "COLUMNS": "250"}
    return subprocess.run([sys.executable, "-m", "kiln.cli", "submit", str(model), "--tune",
                           "off", "--wait", "--timeout", "900"], env=env, capture_output=True,
                          text=True, timeout=960)


def both_keys(client) -> tuple[str, str]:
    keys = wait_for_worker(client, model_format="torch-export")
    (ort,) = [k for k in keys if k.startswith("ort-")]
    (aoti,) = [k for k in keys if k.startswith("aoti-")]
    return ort, aoti


def eager(module, inputs: dict[str, np.ndarray]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return module(torch.from_numpy(inputs["x"])).numpy()


def test_the_agent_gets_the_faster_engine_of_both_backends(stack, agents, tmp_path) -> None:
    client = stack.client()
    ort, aoti = both_keys(client)
    pt2 = tiny_mlp_archive(tmp_path / "tiny.pt2")
    done = submit(stack, pt2)
    assert done.returncode == 0, done.stderr
    model_id = client.upload_model(pt2).id  # the same bytes: the same model
    jobs = {j.fingerprint_key: j for j in client.list_jobs(model_id=model_id)}
    assert set(jobs) == {ort, aoti}, jobs
    assert all(j.status is JobStatus.SUCCEEDED for j in jobs.values()), jobs
    manifests = {key: client.get_manifest(job.artifact_id) for key, job in jobs.items()}
    assert manifests[ort].backend == "onnxruntime" and manifests[aoti].backend == "aotinductor"
    for manifest in manifests.values():  # both verified against the eager program
        assert manifest.verification.passed
        assert "eager ExportedProgram.module()" in manifest.verification.reference
    p50 = {m.backend: m.benchmark.p50_ms for m in manifests.values()}
    faster = min(manifests.values(), key=lambda m: (m.benchmark.p50_ms,
                                                    m.backend != "onnxruntime"))

    client.deploy("tiny", model_id, selector={"site": "a"}, options=OPTIONS)
    agent = AgentProcess(stack, "n1", "site=a", tmp_path).start()
    agents.append(agent)
    served = agent.wait_serving("tiny", artifact_id=faster.artifact_id, tier="exact",
                                timeout_s=180)
    assert served["backend"] == faster.backend
    choice = served["choice"]
    assert choice["reason"] == ("tie" if p50["onnxruntime"] == p50["aotinductor"]
                                else "fastest"), choice
    assert choice["tier"] == "exact" and choice["missing"] == {}
    first = choice["candidates"][0]  # the chosen one
    assert (first["backend"], first["p50_ms"]) == (faster.backend, faster.benchmark.p50_ms)
    assert {c["backend"] for c in choice["candidates"]} == {"onnxruntime", "aotinductor"}
    assert f"{faster.backend} {faster.benchmark.p50_ms:.3f} ms" in choice["message"]
    np.testing.assert_allclose(outputs(agent.infer("tiny", X))[faster.outputs[0].name],
                               eager(tiny_mlp(), X), rtol=1e-4, atol=1e-5)


def test_an_op_onnx_cannot_export_still_reaches_the_agent_through_aotinductor(
        stack, agents, tmp_path) -> None:
    client = stack.client()
    ort, aoti = both_keys(client)
    pt2 = kthvalue_archive(tmp_path / "kth.pt2")
    done = submit(stack, pt2)
    assert done.returncode == 1, done.stderr  # a job it waited for failed
    model_id = client.upload_model(pt2).id
    jobs = {j.fingerprint_key: j for j in client.list_jobs(model_id=model_id)}
    assert jobs[aoti].status is JobStatus.SUCCEEDED, jobs[aoti].error
    failed = jobs[ort]
    assert failed.status is JobStatus.FAILED
    assert failed.error.code == "unsupported_operator", failed.error
    assert failed.error.details["op"] == "aten::kthvalue"
    assert "unsupported_operator" in done.stdout + done.stderr

    client.deploy("kth", model_id, selector={"site": "a"}, options=OPTIONS)
    agent = AgentProcess(stack, "n1", "site=a", tmp_path).start()
    agents.append(agent)
    served = agent.wait_serving("kth", artifact_id=jobs[aoti].artifact_id, tier="exact",
                                timeout_s=180)
    assert served["backend"] == "aotinductor"
    choice = served["choice"]
    assert choice["reason"] == "only"
    assert choice["missing"] == {"onnxruntime": "failed: unsupported_operator"}
    np.testing.assert_allclose(outputs(agent.infer("kth", X))[served["outputs"][0]["name"]],
                               eager(kthvalue_program(), X), rtol=1e-4, atol=1e-5)

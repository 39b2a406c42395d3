"""A node whose tuning context differs gets its own tuning, built by a worker that serves it.
On this machine: the embedded stack (API, a Celery worker), a ``kiln agent`` declaring this
machine in another core-count class (``kiln fingerprint --variant cores=N``) and one
declaring it under another CPU model name only, then a second worker declaring the same
core-count variant.

The tuned fp32 engine races thread policies, so the core class decides its winner: the
variant node is served the engine at ``compatible`` and its own tuning is queued under its
absolute tuning-context key (``<key>-t-<core class>-<tuning features it has>``), which no
worker serves until the variant worker starts and advertises it; that worker then claims
it, publishes under that key, and the node is served its own engine at ``exact`` after that
one build. The node that differs only in the CPU's name queues nothing."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kiln.examples import mlp
from runtime_agent.executors import OnnxRuntimeExecutor, node_fingerprint_keys
from runtime_agent.fingerprint import declare_variant, detect_fingerprint
from schemas.fingerprint import HardwareFingerprint, core_class, tuning_context_key
from schemas.jobs import JobStatus
from schemas.options import CompileOptions, Precision
from tests.integration.agents import AgentProcess, outputs, reference

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

X = {"x": np.random.default_rng(0).normal(size=(4, 64)).astype(np.float32)}
#: Tuned fp32 at level 3: its thread-policy candidates race, so the core class decides the
#: winner, and the engine is hardware-specific (no portable level wins on a guess).
FP32 = CompileOptions(backends=["onnxruntime"], precision=Precision.FP32,
                      optimization_level=3, benchmark_iterations=20)


def own_key(fingerprint: HardwareFingerprint) -> str:
    return tuning_context_key(OnnxRuntimeExecutor.fingerprint_key(fingerprint), fingerprint,
                              OnnxRuntimeExecutor.tuning_features)


def wait_tier(agent: AgentProcess, tier: str, timeout_s: float) -> dict:
    """The deployment's state once ``agent`` serves it at ``tier``."""
    return agent.wait_serving("svc", tier=tier, timeout_s=timeout_s)


def test_a_node_of_another_context_gets_its_own_tuning_from_a_worker_of_it(stack, tmp_path):
    here = detect_fingerprint()
    cores = 64 if core_class(64) != core_class(here.cpu.cores) else 2
    wide = declare_variant(here, f"cores={cores}")
    same = here.model_copy(deep=True, update={"source": "declared"})
    same.cpu.model = f"{here.cpu.model} (another name)"
    files = {}
    for name, fingerprint in (("wide", wide), ("same", same)):
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(fingerprint.model_dump_json())
    key = node_fingerprint_keys(here)["onnxruntime"]
    assert node_fingerprint_keys(wide)["onnxruntime"] == key  # one hardware class, one key
    context = own_key(wide)
    assert context.startswith(f"{key}-t-{core_class(cores).replace('+', 'plus')}")
    assert context != own_key(here) == own_key(same)

    client = stack.client()
    model = mlp(seed=31).SerializeToString()
    model_id = client.upload_model(model).id
    client.deploy("svc", model_id, selector={}, options=FP32)
    node_same = AgentProcess(stack, "node-same", "zone=a", tmp_path)
    node_wide = AgentProcess(stack, "node-wide", "zone=b", tmp_path)
    agents = [node_same, node_wide]
    try:
        node_same.start("--fingerprint-file", str(files["same"]))
        plain = wait_tier(node_same, "exact", 480)
        node_wide.start("--fingerprint-file", str(files["wide"]))
        served = wait_tier(node_wide, "compatible", 120)
        assert served["artifact_id"] == plain["artifact_id"]
        np.testing.assert_allclose(outputs(node_wide.infer("svc", X))["y"],
                                   reference(model, X)["y"], rtol=1e-4, atol=1e-5)
        jobs = {j.fingerprint_key: j for j in client.list_jobs(model_id=model_id)}
        # Its own tuning, under its absolute context key, waits: no worker serves it yet.
        assert {k for k in jobs if "-t-" in k} == {context}, sorted(jobs)
        assert jobs[context].status is JobStatus.WAITING_FOR_HARDWARE

        worker = stack.add_worker("worker-wide", pool="solo",
                                  fingerprint_file=files["wide"])
        mine = wait_tier(node_wide, "exact", 480)
        assert mine["artifact_id"] != plain["artifact_id"]
        jobs = {j.fingerprint_key: j for j in client.list_jobs(model_id=model_id)}
        # One build: claimed and published by the worker of that context, under its key.
        assert [j.fingerprint_key for j in client.list_jobs(model_id=model_id)
                ].count(context) == 1
        assert jobs[context].status is JobStatus.SUCCEEDED
        assert jobs[context].worker.startswith("worker-wide")
        assert jobs[context].artifact_id == mine["artifact_id"]
        detail = client.get_artifact(mine["artifact_id"])
        assert detail["artifact"]["fingerprint_key"] == context
        assert detail["manifest"]["build_fingerprint"]["cpu"]["cores"] == cores
        np.testing.assert_allclose(outputs(node_wide.infer("svc", X))["y"],
                                   reference(model, X)["y"], rtol=1e-4, atol=1e-5)
        # The node that differs only in what no candidate reads keeps the plain engine and
        # queued nothing; the variant's retune is not queued again once it landed.
        time.sleep(2)
        assert node_same.models()["svc"]["artifact_id"] == plain["artifact_id"]
        assert node_wide.models()["svc"]["tier"] == "exact"
        assert {j.fingerprint_key for j in client.list_jobs(model_id=model_id)} == {key, context}
        assert worker.poll() is None
    finally:
        for agent in agents:
            agent.kill()

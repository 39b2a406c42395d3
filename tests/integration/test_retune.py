"""Routing by hardware and retuning for a new chip variant, with two workers and two agents
on this machine: the second of each declares an AVX2-only CPU (x86-64-v3) through a
fingerprint file, as a node of another chip variant would detect it."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kiln.examples import mlp
from runtime_agent.executors import node_fingerprint_keys
from runtime_agent.fingerprint import detect_fingerprint
from schemas import JobStatus
from tests.integration.agents import AgentProcess, outputs, reference
from tests.integration.test_agent import kiln_cli

pytestmark = pytest.mark.integration

X = {"x": np.random.default_rng(0).normal(size=(4, 64)).astype(np.float32)}
WIDE = {"avx512f", "avx512cd", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni",
        "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8"}


def declared_v3(path: Path) -> tuple[Path, str]:
    """A fingerprint file for this machine minus AVX-512/AMX: an AVX2-only variant."""
    fp = detect_fingerprint()
    fp.cpu.features = [f for f in fp.cpu.features if f not in WIDE] + ["avx2", "fma", "f16c",
                                                                          "bmi1", "bmi2"]
    fp.cpu.model = "declared AVX2-only x86-64"
    fp.source = "declared"
    path.write_text(fp.model_dump_json())
    return path, node_fingerprint_keys(fp)["onnxruntime"]


def test_new_chip_variant_gets_fallback_then_its_own_engine(stack, tmp_path):
    client = stack.client()
    here = node_fingerprint_keys(detect_fingerprint())["onnxruntime"]
    fp_file, v3 = declared_v3(tmp_path / "v3.json")
    if here == v3:
        pytest.skip("this machine is itself x86-64-v3: the declared variant would not differ")

    model = mlp(seed=3).SerializeToString()
    model_id = client.upload_model(model).id
    client.deploy("svc", model_id, selector={})  # level 3: hardware-specific engines
    old = AgentProcess(stack, "node-v4", "zone=a", tmp_path).start()
    new = AgentProcess(stack, "node-v3", "zone=b", tmp_path)
    agents = [old, new]
    try:
        assert old.wait_serving("svc")["tier"] == "exact"

        new.start("--fingerprint-file", str(fp_file))
        fallback = new.wait_serving("svc", timeout_s=120)
        assert fallback["tier"] == "fallback"
        np.testing.assert_allclose(outputs(new.infer("svc", X))["y"], reference(model, X)["y"],
                                   rtol=1e-4, atol=1e-5)
        jobs = {j.fingerprint_key: j for j in client.list_jobs(model_id=model_id)}
        assert jobs[v3].status is JobStatus.WAITING_FOR_HARDWARE  # no v3 worker yet
        fleet = client.fleet()
        assert {k["fingerprint_key"]: k["workers"] for k in fleet["keys"]} == {here: 1, v3: 0}
        assert "wait for hardware" in kiln_cli(stack, "fleet")

        # Requests keep flowing while a v3 worker appears, builds, and the node swaps.
        results: list[tuple[int, str]] = []
        stop = threading.Event()

        def hammer() -> None:
            deadline = time.monotonic() + 120
            while not stop.is_set() and time.monotonic() < deadline:
                response = new.infer("svc", X)
                results.append((response.status_code,
                                response.headers.get("X-Kiln-Artifact-Id", "")))

        thread = threading.Thread(target=hammer)
        thread.start()
        try:
            stack.add_worker("worker-v3", "--pool", "solo", "--fingerprint-file", str(fp_file))
            deadline = time.monotonic() + 120
            while new.models()["svc"]["tier"] != "exact":
                assert time.monotonic() < deadline, new.models()
                time.sleep(0.2)
            time.sleep(0.5)
        finally:
            stop.set()
            thread.join(30)
        assert results and all(code == 200 for code, _ in results), results[:5]
        served = [artifact for _, artifact in results]
        assert len(set(served)) == 2 and served[-1] == new.models()["svc"]["artifact_id"]

        jobs = {j.fingerprint_key: j for j in client.list_jobs(model_id=model_id)
                if j.options.optimization_level == 3}
        assert jobs[v3].status is JobStatus.SUCCEEDED
        assert jobs[v3].worker.startswith("worker-v3")  # routed to the v3 worker only
        assert not jobs[here].worker.startswith("worker-v3")
        detail = client.get_artifact(jobs[v3].artifact_id)
        assert detail["manifest"]["build_fingerprint"]["source"] == "declared"
        assert detail["artifact"]["fingerprint_key"] == v3
        coverage = {d["deployment"]: d["keys"] for d in client.fleet()["deployments"]}
        assert coverage["svc"] == {here: "exact", v3: "exact"}
        assert json.loads(kiln_cli(stack, "artifacts", "--json", "--fingerprint", v3))
    finally:
        for agent in agents:
            agent.kill()


def test_agent_builds_on_device_for_its_own_hardware(stack, tmp_path):
    client = stack.client()
    fp_file, v3 = declared_v3(tmp_path / "v3.json")
    model_id = client.upload_model(mlp(seed=4).SerializeToString()).id
    client.deploy("svc", model_id, selector={"site": "edge"})
    node = AgentProcess(stack, "edge-v3", "site=edge", tmp_path)
    try:
        # The node's build worker needs the control plane's state (here: the embedded one).
        node.start("--fingerprint-file", str(fp_file), "--build",
                   env={"KILN_HOME": str(stack.home),
                        "KILN_SIGNING_KEY_PATH": str(stack.home / "signing.key")})
        deadline = time.monotonic() + 120
        while (node.models().get("svc") or {}).get("tier") != "exact":
            assert time.monotonic() < deadline, node.log.read_text()[-2000:]
            time.sleep(0.2)
        (job,) = [j for j in client.list_jobs(model_id=model_id) if j.fingerprint_key == v3]
        assert job.status is JobStatus.SUCCEEDED and job.worker.startswith("edge-v3-build")
    finally:
        node.kill()

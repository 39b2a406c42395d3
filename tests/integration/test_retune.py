"""Routing by hardware and retuning for a new chip variant, with two workers and two agents
on this machine: the second of each declares this CPU one x86-64 level down (an AVX2-only
variant on an AVX-512 machine, an SSE4-only one on an AVX2 machine) through a fingerprint
file, as a node of another chip variant would detect it."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kiln.examples import mlp
from runtime_agent.executors import node_fingerprint_keys
from runtime_agent.fingerprint import detect_fingerprint, older_variant
from schemas.jobs import JobStatus
from schemas.options import CompileOptions
from tests.integration.agents import AgentProcess, outputs, reference
from tests.integration.test_agent import kiln_cli

pytestmark = pytest.mark.integration

X = {"x": np.random.default_rng(0).normal(size=(4, 64)).astype(np.float32)}


def declared_variant(path: Path) -> tuple[Path, str]:
    """A fingerprint file for this machine one x86-64 level down, and its onnxruntime key."""
    fp = detect_fingerprint()
    if fp.cpu.arch != "x86_64":
        pytest.skip(f"declaring an older chip variant needs x86_64, not {fp.cpu.arch}")
    variant = older_variant(fp)
    path.write_text(variant.model_dump_json())
    return path, node_fingerprint_keys(variant)["onnxruntime"]


def test_new_chip_variant_gets_fallback_then_its_own_engine(stack, tmp_path):
    client = stack.client()
    here = node_fingerprint_keys(detect_fingerprint())["onnxruntime"]
    fp_file, variant = declared_variant(tmp_path / "variant.json")
    assert here != variant

    model = mlp(seed=3).SerializeToString()
    model_id = client.upload_model(model).id
    # Level 3 pinned: hardware-specific engines, so the variant needs a fallback first (left to
    # the tuner, a portable level may win here and the variant is served 'compatible' at once).
    client.deploy("svc", model_id, selector={}, options=CompileOptions(optimization_level=3))
    old = AgentProcess(stack, "node-here", "zone=a", tmp_path).start()
    new = AgentProcess(stack, "node-variant", "zone=b", tmp_path)
    agents = [old, new]
    try:
        # Its own engine may still be building when it first serves: the fallback comes first.
        assert old.wait_serving("svc", tier="exact")["tier"] == "exact"

        new.start("--fingerprint-file", str(fp_file))
        fallback = new.wait_serving("svc", timeout_s=120)
        assert fallback["tier"] == "fallback"
        np.testing.assert_allclose(outputs(new.infer("svc", X))["y"], reference(model, X)["y"],
                                   rtol=1e-4, atol=1e-5)
        jobs = {j.fingerprint_key: j for j in client.list_jobs(model_id=model_id)}
        assert jobs[variant].status is JobStatus.WAITING_FOR_HARDWARE  # no variant worker yet
        fleet = client.fleet()
        ort_keys = {k["fingerprint_key"]: k["workers"] for k in fleet["keys"]
                    if k["fingerprint_key"].startswith("ort-")}  # agents list every backend's
        assert ort_keys == {here: 1, variant: 0}
        assert "wait for hardware" in kiln_cli(stack, "fleet")

        # Requests keep flowing while a variant worker appears, builds, and the node swaps.
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
            stack.add_worker("worker-variant", pool="solo", fingerprint_file=str(fp_file))
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
        assert jobs[variant].status is JobStatus.SUCCEEDED
        assert jobs[variant].worker.startswith("worker-variant")  # routed there only
        assert not jobs[here].worker.startswith("worker-variant")
        detail = client.get_artifact(jobs[variant].artifact_id)
        assert detail["manifest"]["build_fingerprint"]["source"] == "declared"
        assert detail["artifact"]["fingerprint_key"] == variant
        coverage = {d["deployment"]: d["keys"] for d in client.fleet()["deployments"]}
        assert coverage["svc"] == {here: "exact", variant: "exact"}
        assert json.loads(kiln_cli(stack, "artifacts", "--json", "--fingerprint", variant))
    finally:
        for agent in agents:
            agent.kill()


def test_agent_builds_on_device_for_its_own_hardware(stack, tmp_path):
    client = stack.client()
    fp_file, variant = declared_variant(tmp_path / "variant.json")
    model_id = client.upload_model(mlp(seed=4).SerializeToString()).id
    client.deploy("svc", model_id, selector={"site": "edge"})
    node = AgentProcess(stack, "edge-variant", "site=edge", tmp_path)
    try:
        # The node's build worker needs the control plane's state (here: the embedded one)
        # and a worker token; it publishes through the agent's API and holds no signing key.
        node.start("--fingerprint-file", str(fp_file), "--build",
                   env={"KILN_HOME": str(stack.home),
                        "KILN_WORKER_TOKEN": stack.worker_token or "",
                        # the embedded stack's defaults, as `kiln up` runs them
                        "KILN_ENV": "dev"})
        deadline = time.monotonic() + 120
        while (node.models().get("svc") or {}).get("tier") != "exact":
            assert time.monotonic() < deadline, node.log.read_text()[-2000:]
            time.sleep(0.2)
        # The node's exact engine (a portable one may be queued for it too, on whichever live
        # worker's portable engines it runs, depending on which worker heartbeat first).
        (job,) = [j for j in client.list_jobs(model_id=model_id)
                  if j.fingerprint_key == variant and j.options.portability == "exact"]
        assert job.status is JobStatus.SUCCEEDED and job.worker.startswith("edge-variant-build")
    finally:
        node.kill()

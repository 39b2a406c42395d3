"""Golden checks: the worker writes golden samples into each artifact; the agent's check runs
a real onnxruntime engine on them and refuses one whose outputs differ."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest

from runtime_agent.executors import blob_filename, load_executor
from runtime_agent.golden import (
    GOLDEN_BLOB,
    GoldenCheckFailed,
    GoldenSample,
    check_golden,
    read_golden,
    write_golden,
)
from tests.runtime_agent.helpers import Fixtures, read_manifest

X = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)


def golden_path(artifact_dir: Path) -> Path:
    manifest = read_manifest(artifact_dir)
    (ref,) = [b for b in manifest.blobs if b.name == GOLDEN_BLOB]
    return artifact_dir / blob_filename(ref)


def test_a_built_artifact_carries_golden_samples_its_engine_passes(built: Fixtures) -> None:
    samples = read_golden(golden_path(built.mlp_a))
    manifest = read_manifest(built.mlp_a)
    assert len(samples) == 2
    assert set(samples[0].inputs) == {s.name for s in manifest.inputs}
    assert set(samples[0].outputs) == {s.name for s in manifest.outputs}
    result = check_golden(load_executor(built.mlp_a, manifest), golden_path(built.mlp_a))
    assert result.passed and result.samples == 2 and result.p50_ms > 0
    assert result.max_abs_error <= manifest.verification.atol + 1e-6


def test_outputs_off_by_more_than_the_tolerance_fail_with_the_worst_element(
        built: Fixtures, tmp_path: Path) -> None:
    # Contrived on purpose: a CPU engine that computes wrong numbers is hard to come by, so
    # the golden outputs are changed instead; the check compares the same two things.
    artifact = Path(shutil.copytree(built.mlp_a, tmp_path / "a"))
    path = golden_path(artifact)
    samples = read_golden(path)
    (name,) = samples[1].outputs
    bad = samples[1].outputs[name].copy()
    bad.flat[5] += 0.5
    write_golden(path, [samples[0], GoldenSample(samples[1].inputs, {name: bad})])
    with pytest.raises(GoldenCheckFailed) as refused:
        check_golden(load_executor(artifact, read_manifest(artifact)), path)
    details = refused.value.details
    assert details["worst_index"] == 5 and details["output"] == name
    assert details["max_abs_error"] == pytest.approx(0.5, abs=1e-3)
    assert f"output {name!r} element 5 is off by 0.5" in refused.value.message


def test_golden_bytes_depend_only_on_the_arrays(built: Fixtures, tmp_path: Path) -> None:
    samples = read_golden(golden_path(built.mlp_a))
    one = write_golden(tmp_path / "one.npz", samples).read_bytes()
    two = write_golden(tmp_path / "two.npz", samples).read_bytes()
    assert one == two


def test_the_agent_never_serves_an_engine_failing_its_golden_check_and_reports_it(
        tmp_path: Path, control_plane, built: Fixtures) -> None:
    """A real agent against the control-plane stub: it serves artifact a, is told to move to
    an artifact whose golden check fails (see ``wrong_golden_artifact``), refuses it while a
    keeps serving, and posts the failing gate, worst element included, to the rollout."""
    from runtime_agent.agent import Agent
    from runtime_agent.config import AgentSettings
    from schemas.agents import ModelState
    from tests.runtime_agent.helpers import (
        TOKEN,
        desired_model,
        free_port,
        wait_for,
        wrong_golden_artifact,
    )

    a = control_plane.add(built.mlp_a)
    bad = control_plane.add(wrong_golden_artifact(built.mlp_a, tmp_path / "bad", "bad-golden",
                                                  built.keys.signer))
    settings = AgentSettings(
        api_url=control_plane.url, token=TOKEN, name="node-1", cache_dir=tmp_path / "cache",
        serve_port=free_port(), trusted_keys=[built.keys.public], heartbeat_s=0.05,
        request_timeout_s=5)
    control_plane.desired = [desired_model("mlp", a).model_copy(update={"rollout_id": "r-0"})]
    with Agent(settings) as agent:
        wait_for(lambda: agent.models.find("mlp") is not None, what="serving a")
        wait_for(lambda: control_plane.rollout_reports, what="a's report")
        rollout_id, passed = control_plane.rollout_reports[0]
        golden = {g.name: g for g in passed.gates}
        assert rollout_id == "r-0" and passed.agent == "node-1" and golden["golden"].passed
        assert golden["latency"].p50_ms > 0 and golden["latency"].benchmark_p50_ms > 0
        # With each heartbeat it then reports what the engine served (error-rate gate).
        response = httpx.post(f"{settings.serve_url}/v1/models/mlp/infer",
                              json={"inputs": {"x": X.tolist()}}, timeout=5)
        assert response.status_code == 200, response.text

        def served_report():
            for rid, report in control_plane.rollout_reports:
                gates = {g.name: g for g in report.gates}
                if rid == "r-0" and "error_rate" in gates and gates["error_rate"].requests:
                    return gates
            return None
        wait_for(served_report, what="a report of served requests")
        gates = served_report()
        assert gates["error_rate"].requests == 1 and gates["error_rate"].errors == 0
        assert gates["golden"].passed and gates["latency"].p50_ms > 0

        control_plane.desired = [desired_model("mlp", bad).model_copy(
            update={"rollout_id": "r-1"})]

        # The agent tries a refused artifact again with backoff (the heartbeat here is
        # 50 ms, so the first retries come fast): any heartbeat may carry the refusal, and
        # a later one a retry in progress.
        def refusal():
            return next((status for status in control_plane.statuses("mlp")
                         if status.state == ModelState.FAILED), None)
        wait_for(refusal, what="the bad engine refused")
        status = refusal()
        assert status.artifact_id == a and status.target_artifact_id == bad
        assert "failed its golden check" in status.error.message
        assert agent.models.find("mlp").artifact_id == a
        reports = [r for rid, r in control_plane.rollout_reports if rid == "r-1"]
        assert reports  # one per try, each the same failing gate
        for report in reports:
            (gate,) = [g for g in report.gates if g.name == "golden"]
            assert not gate.passed and gate.worst_index == 5
            assert gate.max_abs_error == pytest.approx(0.5, abs=1e-3)


def test_a_reduced_precision_engine_is_judged_by_its_accuracy_gate(tmp_path: Path) -> None:
    # A real int8 engine (onnxruntime's dynamic quantization runs on any x86 or Arm CPU): its
    # outputs differ from the fp32 golden outputs element by element beyond any fp32
    # tolerance, yet it passes the gate it was chosen under; a stricter gate refuses it.
    from compiler_worker.pipeline import compile_model
    from kiln.examples import mlp
    from runtime_agent.fingerprint import detect_fingerprint
    from schemas.options import AccuracyGate, AccuracyMetric, CompileOptions

    gate = AccuracyGate(metric=AccuracyMetric.COSINE, threshold=0.99)
    result = compile_model(
        mlp(seed=3).SerializeToString(),
        CompileOptions(precision="int8", tune="off", backends=["onnxruntime"], accuracy=gate,
                       verify_samples=4),
        fingerprint=detect_fingerprint(), workdir=tmp_path / "build")
    manifest = result.manifest
    assert manifest.precision != "fp32"
    artifact = tmp_path / "artifact"
    artifact.mkdir()
    for ref in manifest.blobs:
        shutil.copy(result.blob_paths[ref.name], artifact / blob_filename(ref))
    path = artifact / blob_filename(next(b for b in manifest.blobs if b.name == GOLDEN_BLOB))
    executor = load_executor(artifact, manifest)
    passed = check_golden(executor, path)
    assert passed.passed and passed.max_abs_error > manifest.verification.atol
    strict = manifest.model_copy(update={"options": manifest.options.model_copy(
        update={"accuracy": AccuracyGate(metric=AccuracyMetric.COSINE, threshold=0.9999999)})})
    with pytest.raises(GoldenCheckFailed) as refused:
        check_golden(load_executor(artifact, strict), path)
    assert "misses the accuracy gate" in refused.value.message
    assert refused.value.details["accuracy_metric"] == "cosine"

"""The compile pipeline end to end, on real onnxruntime with models built in code."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
import pytest

from compiler_worker.pipeline import (
    PIPELINE_VERSION,
    artifact_id_for,
    compile_model,
    plan_build,
    write_artifact_dir,
)
from compiler_worker.verify import random_inputs
from kiln.examples import mlp, onnx_test_model, small_cnn
from runtime_agent.executors import load_executor
from schemas.errors import (
    BackendUnavailable,
    Conflict,
    IntegrityError,
    InvalidModel,
    InvalidOptions,
    ModelCheckFailed,
    VerificationFailed,
)
from schemas.fingerprint import HardwareFingerprint
from schemas.jobs import JobStage
from schemas.manifest import ArtifactManifest
from schemas.options import Precision, ShapeProfile
from tests.compiler_worker.helpers import (
    fast_options,
    ill_conditioned_layernorm,
    ill_typed_model,
    sequence_model,
)

ALL_STAGES = [JobStage.LOADING, JobStage.CHECKING, JobStage.OPTIMIZING, JobStage.BUILDING,
              JobStage.VERIFYING, JobStage.BENCHMARKING]


def reference_outputs(model: onnx.ModelProto, feed: dict) -> list[np.ndarray]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options).run(None, feed)


@pytest.mark.parametrize("builder", [small_cnn, mlp], ids=["small_cnn", "mlp"])
@pytest.mark.parametrize("level", [1, 3])
def test_compiles_verifies_and_benchmarks(builder, level: int, tmp_path: Path,
                                          fingerprint: HardwareFingerprint) -> None:
    model = builder()
    data = model.SerializeToString()
    options = fast_options(optimization_level=level)
    stages: list[tuple[JobStage, float]] = []
    result = compile_model(data, options, fingerprint=fingerprint, workdir=tmp_path / "work",
                           on_stage=lambda stage, progress: stages.append((stage, progress)))

    assert [stage for stage, _ in stages] == ALL_STAGES
    assert [p for _, p in stages] == sorted(p for _, p in stages)
    manifest = result.manifest
    assert manifest.backend == "onnxruntime"
    assert manifest.model_sha256 == hashlib.sha256(data).hexdigest()
    assert manifest.options_digest == options.digest()
    assert manifest.fingerprint_key.startswith("ort-cpu-")
    # level 1 is portable (any CPU of the architecture); level 3 needs the exact key
    portable = f"ort-cpu-{fingerprint.cpu.arch.replace('_', '-')}-portable-ort"
    assert (manifest.compatibility_key or "").startswith(portable) is (level == 1)
    assert level == 1 or manifest.compatibility_key is None
    assert manifest.toolchain.endswith(f"+kiln-pipeline-{PIPELINE_VERSION}")
    assert manifest.artifact_id == artifact_id_for(
        manifest.model_sha256, manifest.options_digest, manifest.fingerprint_key,
        manifest.toolchain)
    assert manifest.artifact_id == plan_build(manifest.model_sha256, options,
                                              fingerprint).artifact_id
    assert manifest.build_fingerprint == fingerprint
    assert manifest.passes == ["check", "custom_op_shapes", "upgrade_opset",
                              "strip_initializer_inputs"]
    assert manifest.runtime_config["optimization_level"] == level
    assert manifest.runtime_config["graph_optimization_level"] == 0
    assert manifest.signature is None
    assert manifest.created_at.tzinfo is not None

    verification = manifest.verification
    assert verification.passed and verification.samples == 2
    assert "ORT_DISABLE_ALL on the submitted model" in verification.reference
    assert verification.max_abs_error <= options.tolerance.atol + 1e-3

    bench = manifest.benchmark
    assert bench.iterations == 3 and bench.p50_ms > 0 and bench.reference_p50_ms
    assert next(iter(bench.input_shapes.values()))[0] == 1  # dynamic batch fed as 1

    # The engine, and the golden samples the agent checks it with on the device.
    blob, golden = manifest.blobs
    assert golden.name == "golden.npz"
    assert golden.sha256 == hashlib.sha256(result.blob_paths[golden.name].read_bytes()).hexdigest()
    path = result.blob_paths["engine"]
    assert path.name == "engine.onnx"
    assert blob.size == path.stat().st_size
    assert blob.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


def test_artifact_dir_round_trip(tmp_path: Path, fingerprint: HardwareFingerprint) -> None:
    model = small_cnn()
    result = compile_model(model.SerializeToString(), fast_options(), fingerprint=fingerprint,
                           workdir=tmp_path / "work")
    out = write_artifact_dir(result, tmp_path / "artifact")
    assert sorted(p.name for p in out.iterdir()) == ["engine.onnx", "golden.npz",
                                                   "manifest.json"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    manifest = ArtifactManifest.model_validate_json((out / "manifest.json").read_text())
    assert manifest == result.manifest

    executor = load_executor(out, manifest)
    feed = {"image": np.random.default_rng(7).standard_normal((4, 3, 32, 32)).astype(np.float32)}
    got = executor.run(feed)["probs"]
    np.testing.assert_allclose(got, reference_outputs(model, feed)[0], atol=1e-5, rtol=1e-4)

    with pytest.raises(Conflict, match="already exists"):
        write_artifact_dir(result, out)


def test_artifact_dir_refuses_tampered_blob(tmp_path: Path,
                                            fingerprint: HardwareFingerprint) -> None:
    result = compile_model(mlp().SerializeToString(), fast_options(), fingerprint=fingerprint,
                           workdir=tmp_path / "work")
    with result.blob_paths["engine"].open("r+b") as handle:
        handle.seek(-1, 2)
        last = handle.read(1)
        handle.seek(-1, 2)
        handle.write(bytes([last[0] ^ 0xFF]))
    with pytest.raises(IntegrityError, match="sha256"):
        write_artifact_dir(result, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]  # nothing half-written


def test_light_resnet50_compiles_at_its_own_opset(tmp_path: Path,
                                                     fingerprint: HardwareFingerprint) -> None:
    model = onnx_test_model("light_resnet50")
    result = compile_model(
        model.SerializeToString(),
        # onnxruntime's engine: its opset is the point (other backends would compete else).
        fast_options(verify_samples=1, benchmark_iterations=2, backends=["onnxruntime"]),
        fingerprint=fingerprint, workdir=tmp_path)
    manifest = result.manifest
    assert "upgrade_opset" in manifest.passes
    assert [(s.name, s.shape) for s in manifest.inputs] == [("gpu_0/data_0", [1, 3, 224, 224])]
    assert manifest.verification.passed
    assert "the submitted model" in manifest.verification.reference
    engine = onnx.load(result.blob_paths["engine"], load_external_data=False)
    assert [v.name for v in engine.graph.input] == ["gpu_0/data_0"]
    assert {o.domain: o.version for o in engine.opset_import}[""] == 9  # onnxruntime runs 9


def test_fused_layernorm_on_ill_conditioned_input_fails_verification(
        tmp_path: Path, fingerprint: HardwareFingerprint) -> None:
    data = ill_conditioned_layernorm().SerializeToString()
    # Basic optimizations keep the primitives: numerics match the reference.
    passed = compile_model(data, fast_options(optimization_level=1), fingerprint=fingerprint,
                           workdir=tmp_path / "basic")
    assert passed.manifest.verification.passed
    # Extended optimizations fuse the LayerNormalization kernel, which disagrees.
    stages: list[JobStage] = []
    with pytest.raises(VerificationFailed) as info:
        compile_model(data, fast_options(optimization_level=2), fingerprint=fingerprint,
                      workdir=tmp_path / "extended", on_stage=lambda s, p: stages.append(s))
    error = info.value
    assert stages[-1] == JobStage.VERIFYING
    assert "atol=0.0001, rtol=0.001" in error.message
    assert "y: max abs" in error.message
    assert error.details["passed"] is False
    assert error.details["max_abs_error"] > 1e-3
    assert error.details["per_output"]["y"]["mismatched"] > 0
    assert error.to_body().code == "verification_failed"


@pytest.mark.parametrize(
    ("data", "error"),
    [(b"", InvalidModel), (b"garbage" * 10, InvalidModel),
     (small_cnn().SerializeToString()[:777], InvalidModel),
     (ill_typed_model().SerializeToString(), ModelCheckFailed)],
    ids=["empty", "garbage", "truncated", "checker"],
)
def test_bad_models_fail_with_typed_errors(data: bytes, error: type, tmp_path: Path,
                                           fingerprint: HardwareFingerprint) -> None:
    with pytest.raises(error):
        compile_model(data, fast_options(), fingerprint=fingerprint, workdir=tmp_path)


def test_fp16_on_cpu_is_refused_before_any_work(tmp_path: Path,
                                                fingerprint: HardwareFingerprint) -> None:
    stages: list[JobStage] = []
    with pytest.raises(BackendUnavailable, match="builds no fp16 engines"):
        compile_model(mlp().SerializeToString(), fast_options(precision=Precision.FP16),
                      fingerprint=fingerprint, workdir=tmp_path,
                      on_stage=lambda s, p: stages.append(s))
    assert stages == [JobStage.LOADING]
    assert list(tmp_path.iterdir()) == []


def test_dynamic_non_batch_dim_needs_a_shape_profile(tmp_path: Path,
                                                     fingerprint: HardwareFingerprint) -> None:
    data = sequence_model(dims=["B", "S", 8]).SerializeToString()
    with pytest.raises(InvalidOptions, match="dynamic dimension 'S' at axis 1"):
        compile_model(data, fast_options(), fingerprint=fingerprint, workdir=tmp_path / "a")
    options = fast_options(shapes={"x": ShapeProfile(min=[1, 1, 8], opt=[2, 5, 8],
                                                     max=[4, 64, 8])})
    result = compile_model(data, options, fingerprint=fingerprint, workdir=tmp_path / "b")
    assert result.manifest.benchmark.input_shapes == {"x": [2, 5, 8]}
    assert result.manifest.inputs[0].shape == ["B", "S", 8]


def test_disabled_passes_change_the_artifact_key(tmp_path: Path,
                                                 fingerprint: HardwareFingerprint) -> None:
    data = onnx_test_model("light_resnet50").SerializeToString()
    options = fast_options(optimization_level=0, verify_samples=1, benchmark_iterations=1)
    with pytest.raises(InvalidOptions, match="the passes are"):
        compile_model(data, options, fingerprint=fingerprint, workdir=tmp_path / "x",
                      disabled_passes=frozenset({"nope"}))
    sha = hashlib.sha256(data).hexdigest()
    default = plan_build(sha, options, fingerprint)
    stripped_off = plan_build(sha, options, fingerprint,
                              disabled_passes=frozenset({"strip_initializer_inputs"}))
    assert stripped_off.artifact_id != default.artifact_id
    assert stripped_off.toolchain.endswith("+without-strip_initializer_inputs")
    result = compile_model(data, options, fingerprint=fingerprint, workdir=tmp_path / "y",
                           disabled_passes=frozenset({"strip_initializer_inputs"}))
    assert result.manifest.artifact_id == stripped_off.artifact_id
    assert "strip_initializer_inputs" not in result.manifest.passes
    assert [s.name for s in result.manifest.inputs] == ["gpu_0/data_0"]


def test_artifact_id_is_deterministic_and_keyed_on_every_part() -> None:
    parts = ["a" * 64, "b" * 64, "ort-cpu-x86-64-v3-ort1.32", "onnxruntime-1.32.0+kiln-pipeline-1"]
    first = artifact_id_for(*parts)
    assert first == artifact_id_for(*parts)
    assert len(first) == 32 and int(first, 16) >= 0
    for i in range(4):
        changed = list(parts)
        changed[i] = changed[i] + "x"
        assert artifact_id_for(*changed) != first


def test_compiling_twice_gives_the_same_artifact_id(tmp_path: Path,
                                                    fingerprint: HardwareFingerprint) -> None:
    data = mlp().SerializeToString()
    tuned = fast_options(tune="auto")
    a = compile_model(data, tuned, fingerprint=fingerprint, workdir=tmp_path / "a")
    b = compile_model(data, tuned, fingerprint=fingerprint, workdir=tmp_path / "a")
    assert a.manifest.artifact_id == b.manifest.artifact_id  # the cache key, whatever won
    # The same candidate builds the same bytes, reproducibly (which candidate wins a tuning
    # depends on timings, so the default one is compared).
    off = fast_options(tune="off")
    a = compile_model(data, off, fingerprint=fingerprint, workdir=tmp_path / "c")
    b = compile_model(data, off, fingerprint=fingerprint, workdir=tmp_path / "c")
    assert a.manifest.blobs == b.manifest.blobs


def test_random_inputs_match_the_signature(tmp_path: Path,
                                           fingerprint: HardwareFingerprint) -> None:
    result = compile_model(small_cnn().SerializeToString(), fast_options(),
                           fingerprint=fingerprint, workdir=tmp_path)
    feed = random_inputs(result.manifest.inputs, result.manifest.options, seed=3)
    executor = load_executor(result.blob_paths["engine"].parent, result.manifest)
    assert executor.run(feed)["probs"].shape == (1, 10)

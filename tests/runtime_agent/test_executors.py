"""The executor registry and the onnxruntime executor on a hand-made artifact directory."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import onnx
import pytest

from kiln.examples import mlp
from runtime_agent import executors
from runtime_agent.executors import OnnxRuntimeExecutor, blob_filename, load_executor
from schemas.errors import BackendUnavailable, IntegrityError, InvalidRequest
from schemas.fingerprint import CpuInfo, HardwareFingerprint
from schemas.manifest import (
    ArtifactManifest,
    BenchmarkResult,
    BlobRef,
    TensorSpec,
    VerificationResult,
)
from schemas.options import CompileOptions

ZERO = "0" * 64


def make_artifact(directory: Path, *, runtime_config: dict | None = None,
                  backend: str = "onnxruntime") -> ArtifactManifest:
    """``mlp()`` as an onnxruntime artifact directory (engine.onnx), and its manifest."""
    data = mlp().SerializeToString()
    (directory / "engine.onnx").write_bytes(data)
    return ArtifactManifest(
        artifact_id="test-artifact",
        model_sha256=hashlib.sha256(data).hexdigest(),
        options_digest=ZERO,
        options=CompileOptions(),
        backend=backend,
        fingerprint_key="ort-cpu-test",
        toolchain="onnxruntime-test",
        build_fingerprint=HardwareFingerprint(cpu=CpuInfo(arch="x86_64")),
        blobs=[BlobRef(name="engine", sha256=hashlib.sha256(data).hexdigest(), size=len(data),
                       media_type="application/x-onnx")],
        inputs=[TensorSpec(name="x", dtype="float32", shape=["N", 64])],
        outputs=[TensorSpec(name="y", dtype="float32", shape=["N", 16])],
        runtime_config=runtime_config if runtime_config is not None else {
            "graph_optimization_level": 0, "providers": ["CPUExecutionProvider"]},
        verification=VerificationResult(passed=True, samples=1, max_abs_error=0, max_rel_error=0,
                                        atol=0, rtol=0, reference="test"),
        benchmark=BenchmarkResult(iterations=1, warmup=0, p50_ms=1, p90_ms=1, mean_ms=1,
                                  min_ms=1),
        created_at=datetime.now(UTC),
    )


@pytest.fixture
def executor(tmp_path: Path) -> OnnxRuntimeExecutor:
    loaded = load_executor(tmp_path, make_artifact(tmp_path))
    assert isinstance(loaded, OnnxRuntimeExecutor)
    return loaded


def test_runs_like_onnxruntime(executor: OnnxRuntimeExecutor) -> None:
    import onnxruntime as ort

    x = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
    session = ort.InferenceSession(mlp().SerializeToString(), providers=["CPUExecutionProvider"])
    expected = session.run(None, {"x": x})[0]
    outputs = executor.run({"x": x})
    assert list(outputs) == ["y"]
    np.testing.assert_allclose(outputs["y"], expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("feed", "message"),
    [
        ({}, r"expected inputs \[x: float32\['N', 64\]\]; given \[\] \(missing \['x'\]"),
        ({"x": np.zeros((1, 64), np.float32), "z": np.zeros(1)}, r"unexpected \['z'\]"),
        ({"x": np.zeros((1, 64), np.float64)}, "expected dtype float32.*given float64"),
        ({"x": np.zeros((64,), np.float32)}, r"expected rank 2.*given shape \[64\]"),
        ({"x": np.zeros((1, 63), np.float32)}, r"expected dimension 1 to be 64.*\[1, 63\]"),
        ({"x": [[0.0] * 64]}, "expected a numpy array or a DLPack tensor.*given list"),
    ],
)
def test_invalid_inputs_are_refused(executor: OnnxRuntimeExecutor, feed: dict,
                                    message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        executor.run(feed)


def test_dynamic_dimension_accepts_any_size(executor: OnnxRuntimeExecutor) -> None:
    for batch in (1, 7):
        assert executor.run({"x": np.zeros((batch, 64), np.float32)})["y"].shape == (batch, 16)


def test_blob_filename() -> None:
    assert blob_filename(BlobRef(name="engine", sha256=ZERO, size=1,
                                 media_type="application/x-onnx")) == "engine.onnx"
    assert blob_filename(BlobRef(name="engine", sha256=ZERO, size=1,
                                 media_type="application/x-tensorrt-plan")) == "engine.plan"
    assert blob_filename(BlobRef(name="calibration", sha256=ZERO, size=1)) == "calibration"
    for bad in ("../evil", "a/b", "", ".hidden"):
        with pytest.raises(InvalidRequest):
            blob_filename(BlobRef(name=bad, sha256=ZERO, size=1))


def test_registry_lists_backends_for_unknown_name() -> None:
    assert executors.get("onnxruntime") is OnnxRuntimeExecutor
    with pytest.raises(BackendUnavailable, match=r"Currently registered backends are: .*onnxrunt"):
        executors.get("tvm")


def test_registry_refuses_duplicates() -> None:
    with pytest.raises(ValueError, match="already registered"):
        executors.register("onnxruntime", OnnxRuntimeExecutor)


def test_blob_of_wrong_size_is_refused(tmp_path: Path) -> None:
    manifest = make_artifact(tmp_path)
    with (tmp_path / "engine.onnx").open("ab") as handle:
        handle.write(b"\0")
    with pytest.raises(IntegrityError, match="the manifest lists"):
        load_executor(tmp_path, manifest)


def test_missing_blob_is_refused(tmp_path: Path) -> None:
    manifest = make_artifact(tmp_path)
    (tmp_path / "engine.onnx").unlink()
    with pytest.raises(IntegrityError, match="does not exist"):
        load_executor(tmp_path, manifest)


def test_unavailable_provider_is_named(tmp_path: Path) -> None:
    manifest = make_artifact(tmp_path, runtime_config={"providers": ["TensorrtExecutionProvider"]})
    with pytest.raises(BackendUnavailable, match=r"Requested providers were: .*Tensorrt.*avail"):
        load_executor(tmp_path, manifest)


def test_corrupt_engine_is_backend_error(tmp_path: Path) -> None:
    manifest = make_artifact(tmp_path)
    data = (tmp_path / "engine.onnx").read_bytes()
    (tmp_path / "engine.onnx").write_bytes(b"\x01" * len(data))
    with pytest.raises(BackendUnavailable, match="could not load"):
        load_executor(tmp_path, manifest)


def test_executor_refuses_other_backends_artifacts(tmp_path: Path) -> None:
    manifest = make_artifact(tmp_path, backend="tensorrt")
    with pytest.raises(InvalidRequest, match="runs 'onnxruntime' artifacts"):
        OnnxRuntimeExecutor(tmp_path, manifest)
    with pytest.raises(BackendUnavailable, match="'tensorrt'"):
        load_executor(tmp_path, manifest)


def test_engine_model_is_valid_onnx(tmp_path: Path) -> None:
    make_artifact(tmp_path)
    onnx.checker.check_model(str(tmp_path / "engine.onnx"))

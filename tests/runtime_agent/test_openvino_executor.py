"""The OpenVINO executor: keys from the fingerprint, a real exported blob imported as an agent
imports it, the compile properties applied again, and blobs of another version or CPU refused
before the import, naming both sides."""

from __future__ import annotations

import hashlib
import io
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest

from runtime_agent import executors
from runtime_agent.executors import load_executor
from runtime_agent.executors.openvino.executor import (
    ENGINE_MEDIA_TYPE,
    OpenVinoExecutor,
    blob_header,
    has_bf16,
    kernel_class,
    kernel_features,
)
from runtime_agent.fingerprint import detect_cpu, detect_fingerprint, isa_class
from schemas.errors import BackendUnavailable, FingerprintMismatch
from schemas.fingerprint import CpuInfo, HardwareFingerprint, RuntimeVersions
from schemas.manifest import (
    ArtifactManifest,
    BenchmarkResult,
    BlobRef,
    TensorSpec,
    VerificationResult,
)
from schemas.options import CompileOptions

ov = pytest.importorskip("openvino")

V4 = ["ssse3", "sse4_1", "sse4_2", "popcnt", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2",
      "avx512f", "avx512cd", "avx512dq", "avx512bw", "avx512vl"]
SPR = [*V4, "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16",
       "amx_int8"]
WEIGHTS = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)


def fp(features: list[str], *, arch: str = "x86_64",
       openvino: str | None = "2026.4.1") -> HardwareFingerprint:
    return HardwareFingerprint(cpu=CpuInfo(arch=arch, features=features),
                               runtimes=RuntimeVersions(openvino=openvino))


def test_key_names_version_class_and_kernel_features() -> None:
    assert OpenVinoExecutor.fingerprint_key(fp(SPR)) == \
        "ov-cpu-x86-64-v4-amx-avxvnni-bf16-fp16-vnni-ov2026.4.1"
    assert OpenVinoExecutor.fingerprint_key(fp(V4)) == "ov-cpu-x86-64-v4-ov2026.4.1"
    assert OpenVinoExecutor.fingerprint_key(fp([*V4, "avx512_vnni"], openvino="2025.3.0")) == \
        "ov-cpu-x86-64-v4-vnni-ov2025.3.0"
    assert OpenVinoExecutor.fingerprint_key(fp(["dotprod", "i8mm", "bf16"], arch="aarch64")) == \
        "ov-cpu-armv8-dotprod-bf16-i8mm-ov2026.4.1"
    # AMX counts only with its tile unit and both data types.
    assert "amx" not in kernel_features(CpuInfo(arch="x86_64", features=[*V4, "amx_bf16"]))
    here = detect_fingerprint()
    if OpenVinoExecutor.supports(here):
        key = OpenVinoExecutor.fingerprint_key(here)
        assert key.startswith(f"ov-cpu-{isa_class(here.cpu)}") and key == key.lower()


def test_support_and_compatibility_are_the_exact_key() -> None:
    assert not OpenVinoExecutor.supports(fp(SPR, openvino=None))
    assert not OpenVinoExecutor.supports(fp([], arch="riscv64"))
    with pytest.raises(BackendUnavailable, match="OpenVINO version"):
        OpenVinoExecutor.fingerprint_key(fp(SPR, openvino=None))
    assert OpenVinoExecutor.compatible(fp(SPR), fp(SPR))
    assert not OpenVinoExecutor.compatible(fp(SPR), fp(SPR, openvino="2026.4.0"))
    assert not OpenVinoExecutor.compatible(fp(SPR), fp([*V4, "avx512_vnni", "avx512_bf16"]))
    assert OpenVinoExecutor.compatibility_key(fp(SPR)) is None
    assert has_bf16(CpuInfo(arch="x86_64", features=[*V4, "avx512_bf16"]))
    assert not has_bf16(CpuInfo(arch="x86_64", features=[*V4, "avx512_vnni"]))


def test_registered_and_reported_after_onnxruntime() -> None:
    assert executors.get("openvino") is OpenVinoExecutor
    keys = list(executors.node_fingerprint_keys(fp(SPR)))
    assert "openvino" in keys
    here = detect_fingerprint()
    if "onnxruntime" in executors.node_fingerprint_keys(here):
        order = list(executors.node_fingerprint_keys(here))
        assert order.index("onnxruntime") < order.index("openvino")


def _blob(properties: dict[str, str]) -> bytes:
    """A real exported compiled model: y = x @ WEIGHTS."""
    import openvino.opset13 as ops

    x = ops.parameter([1, 256], np.float32, name="x")
    y = ops.matmul(x, ops.constant(WEIGHTS), False, False)
    y.output(0).get_tensor().set_names({"y"})
    compiled = ov.Core().compile_model(ov.Model([y], [x], "mm"), "CPU", properties)
    stream = io.BytesIO()
    compiled.export_model(stream)
    return stream.getvalue()


def _artifact(directory: Path, blob: bytes, runtime_config: dict) -> ArtifactManifest:
    (directory / "engine.ovblob").write_bytes(blob)
    digest = hashlib.sha256(blob).hexdigest()
    here = detect_fingerprint()
    return ArtifactManifest(
        artifact_id="ov-test", model_sha256=digest, options_digest="0" * 64,
        options=CompileOptions(), backend="openvino", fingerprint_key="ov-test",
        toolchain="openvino-test", build_fingerprint=here,
        blobs=[BlobRef(name="engine", sha256=digest, size=len(blob),
                       media_type=ENGINE_MEDIA_TYPE)],
        inputs=[TensorSpec(name="x", dtype="float32", shape=[1, 256])],
        outputs=[TensorSpec(name="y", dtype="float32", shape=[1, 256])],
        runtime_config=runtime_config,
        verification=VerificationResult(passed=True, samples=1, max_abs_error=0,
                                        max_rel_error=0, atol=0, rtol=0, reference="test"),
        benchmark=BenchmarkResult(iterations=1, warmup=0, p50_ms=1, p90_ms=1, mean_ms=1,
                                  min_ms=1),
        created_at=datetime.now(UTC))


def _config(**overrides: object) -> dict:
    cpu = detect_cpu()
    config: dict[str, object] = {
        "device": "CPU", "openvino_version": OpenVinoExecutor.probe_version(),
        "cpu_class": isa_class(cpu), "cpu_features": kernel_features(cpu),
        "properties": {"INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY"},
        "input_names": ["x"], "output_names": ["y"], "precision": "fp32"}
    config.update(overrides)
    return config


def test_imports_the_blob_and_applies_its_precision_again(tmp_path: Path) -> None:
    blob = _blob({"INFERENCE_PRECISION_HINT": "f32"})
    header = blob_header(blob)
    assert header is not None and header[0] == OpenVinoExecutor.probe_version()
    executor = load_executor(tmp_path, _artifact(tmp_path, blob, _config()))
    x = np.random.default_rng(1).standard_normal((1, 256)).astype(np.float32)
    got = executor.run({"x": x})["y"]
    assert got.dtype == np.float32 and got.shape == (1, 256)
    # fp32 within float rounding: on a CPU whose plugin defaults to bf16 this holds only
    # because the import is given INFERENCE_PRECISION_HINT again.
    np.testing.assert_allclose(got, x @ WEIGHTS, atol=1e-3, rtol=1e-4)


def test_an_import_without_the_recorded_precision_would_not_be_fp32(tmp_path: Path) -> None:
    """Why ``properties`` travel: where the CPU plugin defaults to bf16, a blob imported
    bare runs in bf16. Skipped on CPUs without bf16 (there the default is fp32)."""
    if not has_bf16(detect_cpu()):
        pytest.skip("this CPU has no bf16: the plugin's default precision is fp32 here")
    blob = _blob({"INFERENCE_PRECISION_HINT": "f32"})
    bare = ov.Core().import_model(io.BytesIO(blob), "CPU")
    x = np.random.default_rng(1).standard_normal((1, 256)).astype(np.float32)
    assert np.abs(bare({"x": x})[0] - x @ WEIGHTS).max() > 1e-2


def test_another_openvino_version_is_refused_before_the_import(tmp_path: Path) -> None:
    blob = _blob({"INFERENCE_PRECISION_HINT": "f32"})
    manifest = _artifact(tmp_path, blob, _config(openvino_version="2025.3.0"))
    with pytest.raises(FingerprintMismatch, match=r"OpenVINO 2025\.3\.0.*this node runs "
                                                  r"OpenVINO \d") as refused:
        load_executor(tmp_path, manifest)
    assert refused.value.details["blob_openvino"] == "2025.3.0"


def test_another_cpu_is_refused_before_the_import(tmp_path: Path) -> None:
    blob = _blob({"INFERENCE_PRECISION_HINT": "f32"})
    cpu = detect_cpu()
    other = [f for f in ("amx", "bf16", "vnni") if f not in kernel_features(cpu)] or ["sve"]
    manifest = _artifact(tmp_path, blob, _config(cpu_features=[*kernel_features(cpu),
                                                               other[0]]))
    with pytest.raises(FingerprintMismatch, match="this node's CPU is") as refused:
        load_executor(tmp_path, manifest)
    assert refused.value.details["node_cpu"] == kernel_class(cpu)
    assert other[0] in refused.value.details["blob_cpu"]


def test_a_blob_openvino_itself_refuses_is_typed(tmp_path: Path) -> None:
    """The manifest agrees with the node but the blob's own header does not (a blob of
    another release): OpenVINO's refusal comes back typed, naming the blob's header."""
    blob = _blob({"INFERENCE_PRECISION_HINT": "f32"})
    version = OpenVinoExecutor.probe_version() or ""
    # Same length, so the header's length field still holds.
    forged = blob.replace(f"ov={version}".encode(), f"ov={'9' * len(version)}".encode(), 1)
    assert forged != blob
    with pytest.raises(FingerprintMismatch, match="refuses the compiled blob"):
        load_executor(tmp_path, _artifact(tmp_path, forged, _config()))

"""Backend registry, backend choice, and the onnxruntime backend's keys and refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from compiler_worker import backends
from compiler_worker.backends import OnnxRuntimeBackend, backend_for
from compiler_worker.backends.base import major_minor, slug, version_tuple
from kiln.examples import mlp
from runtime_agent.fingerprint import isa_class
from schemas.errors import BackendUnavailable, FingerprintMismatch, InvalidOptions, InvalidRequest
from schemas.fingerprint import AcceleratorInfo, CpuInfo, HardwareFingerprint, RuntimeVersions
from schemas.options import CompileOptions, Precision

V3 = ["ssse3", "sse4_1", "sse4_2", "popcnt", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2"]
V4 = [*V3, "avx512f", "avx512cd", "avx512dq", "avx512bw", "avx512vl"]


def cpu_fp(features: list[str], *, arch: str = "x86_64", ort: str | None = "1.32.0",
           accelerators: list[AcceleratorInfo] | None = None,
           tensorrt: str | None = None) -> HardwareFingerprint:
    return HardwareFingerprint(
        cpu=CpuInfo(arch=arch, features=features),
        accelerators=accelerators or [],
        runtimes=RuntimeVersions(onnxruntime=ort, tensorrt=tensorrt),
    )


ORT = OnnxRuntimeBackend()


def test_helpers() -> None:
    assert slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert major_minor("1.32.0") == "1.32" and major_minor("dev") is None
    assert version_tuple("10.3.0.26") == (10, 3, 0, 26) and version_tuple(None) == ()


def test_onnxruntime_key(fingerprint: HardwareFingerprint) -> None:
    assert ORT.fingerprint_key(cpu_fp(V4)) == "ort-cpu-x86-64-v4-ort1.32"
    assert ORT.fingerprint_key(cpu_fp(["neon", "sve"], arch="aarch64", ort="1.18.1")) == \
        "ort-cpu-armv8-sve-ort1.18"
    key = ORT.fingerprint_key(fingerprint)
    assert key.startswith(f"ort-cpu-{isa_class(fingerprint.cpu)}-ort")
    assert all(c.isalnum() or c in ".-" for c in key) and key == key.lower()


def test_onnxruntime_supports() -> None:
    assert ORT.supports(cpu_fp(V3))
    assert not ORT.supports(cpu_fp(V3, ort=None))
    assert not ORT.supports(cpu_fp([], arch="riscv64"))
    with pytest.raises(BackendUnavailable, match="no onnxruntime version"):
        ORT.fingerprint_key(cpu_fp(V3, ort=None))


@pytest.mark.parametrize(
    ("built", "node", "level", "expected"),
    [
        (cpu_fp(V4), cpu_fp(V4), 3, True),  # same key
        (cpu_fp(V4), cpu_fp(V3), 3, False),  # NCHWc layouts of a v4 build need v4
        (cpu_fp(V4), cpu_fp(V3), None, False),  # unknown level: treated as hardware-specific
        (cpu_fp(V4), cpu_fp(V3), 2, True),  # portable levels: same arch and ORT major.minor
        (cpu_fp(V4), cpu_fp(V3, ort="1.32.5"), 1, True),
        (cpu_fp(V4), cpu_fp(V3, ort="1.31.0"), 1, False),
        (cpu_fp(V4), cpu_fp(["neon"], arch="aarch64"), 0, False),
        (cpu_fp(V4), cpu_fp(V4, ort=None), 1, False),
    ],
)
def test_onnxruntime_compatibility(built, node, level, expected) -> None:
    config = None if level is None else {"optimization_level": level}
    assert ORT.compatible(built, node, config) is expected


def test_registry() -> None:
    assert backends.get("onnxruntime") is not None
    # by priority
    assert backends.names() == ["tensorrt", "onnxruntime", "openvino", "aotinductor", "iree"]
    assert [b.name for b in backends.available()] == backends.names()
    with pytest.raises(BackendUnavailable, match=r"Currently registered backends are: \['tensor"):
        backends.get("tvm")
    with pytest.raises(ValueError, match="already registered"):
        backends.register("onnxruntime", OnnxRuntimeBackend())


def test_backend_for_cpu_node_picks_onnxruntime() -> None:
    assert backend_for(cpu_fp(V4), CompileOptions()).name == "onnxruntime"


def test_backend_for_gpu_node_prefers_tensorrt() -> None:
    gpu = cpu_fp(V4, accelerators=[AcceleratorInfo(name="NVIDIA L4", compute_capability="8.9")],
                 tensorrt="10.3.0")
    assert backend_for(gpu, CompileOptions()).name == "tensorrt"
    assert backend_for(gpu, CompileOptions(backends=["onnxruntime"])).name == "onnxruntime"
    assert backend_for(gpu, CompileOptions(precision=Precision.FP16)).name == "tensorrt"


def test_backend_for_explains_every_refusal() -> None:
    with pytest.raises(BackendUnavailable, match="tensorrt: does not support this hardware") as e:
        backend_for(cpu_fp(V4), CompileOptions(backends=["tensorrt"]))
    assert e.value.details["registered"] == ["tensorrt", "onnxruntime", "openvino",
                                             "aotinductor", "iree"]
    with pytest.raises(BackendUnavailable, match="onnxruntime: the onnxruntime CPU backend builds "
                                                 "no fp16 engines"):
        backend_for(cpu_fp(V4), CompileOptions(precision=Precision.FP16))


def test_onnxruntime_build_refuses_fp16(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(mlp(), path)
    with pytest.raises(BackendUnavailable, match="builds no fp16 engines"):
        ORT.build(path, CompileOptions(precision=Precision.FP16), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_onnxruntime_build_checks_its_inputs(tmp_path: Path,
                                             fingerprint: HardwareFingerprint) -> None:
    with pytest.raises(InvalidRequest, match="does not exist"):
        ORT.build(tmp_path / "absent.onnx", CompileOptions(), tmp_path, fingerprint=fingerprint)
    path = tmp_path / "m.onnx"
    onnx.save(mlp(), path)
    other = fingerprint.model_copy(
        update={"runtimes": {**fingerprint.runtimes, **{"onnxruntime": "1.17.0"}}})
    with pytest.raises(FingerprintMismatch, match=r"declares onnxruntime 1\.17\.0"):
        ORT.build(path, CompileOptions(), tmp_path / "out", fingerprint=other)


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_onnxruntime_build_writes_an_engine(tmp_path: Path, level: int,
                                            fingerprint: HardwareFingerprint) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(mlp(), path)
    built = ORT.build(path, CompileOptions(optimization_level=level), tmp_path / "out",
                      fingerprint=fingerprint)
    [(name, engine, media_type)] = built.blobs
    assert (name, media_type) == ("engine", "application/x-onnx")
    assert engine.stat().st_size > 0
    assert built.runtime_config == {"graph_optimization_level": 0, "optimization_level": level,
                                    "providers": ["CPUExecutionProvider"], "precision": "fp32"}
    assert built.toolchain == ORT.toolchain()
    assert built.toolchain.startswith("onnxruntime-") and "+kiln-pipeline-" in built.toolchain


def test_onnxruntime_candidates_follow_options(fingerprint: HardwareFingerprint) -> None:
    fp32 = ORT.candidates(fingerprint, CompileOptions())
    assert [c.config["optimization_level"] for c in fp32][:3] == [3, 1, 2]
    assert {c.precision for c in fp32} == {"fp32"}
    auto = ORT.candidates(fingerprint, CompileOptions(precision="auto"))
    assert {"int8-dynamic", "int8-static-qdq"} <= {c.precision for c in auto}
    assert next(c for c in auto if c.precision == "int8-static-qdq").needs_calibration
    pinned = ORT.candidates(fingerprint, CompileOptions(optimization_level=1, precision="int8"))
    assert {c.config["optimization_level"] for c in pinned} == {1}
    assert {c.precision for c in pinned} == {"int8-dynamic", "int8-static-qdq"}
    with pytest.raises(InvalidOptions, match="portability: portable"):
        ORT.candidates(fingerprint, CompileOptions(optimization_level=3, portability="portable"))


def test_bf16_is_skipped_without_the_instructions(fingerprint: HardwareFingerprint) -> None:
    x86 = fingerprint.model_copy(update={"cpu": fingerprint.cpu.model_copy(
        update={"arch": "x86_64", "features": ["avx2", "avx512_bf16"]})})
    [bf16] = [c for c in ORT.candidates(x86, CompileOptions(precision="auto"))
              if c.precision.startswith("bf16")]
    assert "aarch64" in bf16.skip
    arm = fingerprint.model_copy(update={"cpu": fingerprint.cpu.model_copy(
        update={"arch": "aarch64", "features": ["neon", "bf16"]})})
    [bf16] = [c for c in ORT.candidates(arm, CompileOptions(precision="bf16"))]
    assert not bf16.skip and bf16.config["bf16_fastmath"]


def test_large_engines_keep_their_initializers_in_a_second_blob(
        tmp_path: Path, fingerprint: HardwareFingerprint, monkeypatch) -> None:
    """Engines past protobuf's 2 GB limit are saved with external data; the threshold is
    lowered here so a small model takes the same path."""
    from compiler_worker.backends.onnxruntime import backend as ort_backend
    from compiler_worker.pipeline import compile_model, write_artifact_dir
    from runtime_agent.executors import load_executor

    monkeypatch.setattr(ort_backend, "EXTERNAL_DATA_THRESHOLD", 0)
    result = compile_model(mlp().SerializeToString(), CompileOptions(tune="off"),
                           fingerprint=fingerprint, workdir=tmp_path / "work")
    from runtime_agent.golden import GOLDEN_BLOB

    names = [blob.name for blob in result.manifest.blobs]
    assert names == ["engine", ort_backend.ENGINE_DATA_BLOB, GOLDEN_BLOB]
    engine = onnx.load(str(result.blob_paths["engine"]), load_external_data=False)
    assert any(t.data_location == onnx.TensorProto.EXTERNAL for t in engine.graph.initializer)
    out = write_artifact_dir(result, tmp_path / "artifact")
    x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    got = load_executor(out, result.manifest).run({"x": x})["y"]
    import onnxruntime as ort

    want = ort.InferenceSession(mlp().SerializeToString()).run(["y"], {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)

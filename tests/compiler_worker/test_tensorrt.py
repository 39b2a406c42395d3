"""The TensorRT backend's pure logic. No test here builds an engine: TensorRT is not installed
on CI machines, and an engine is never faked."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import onnx
import pytest

from compiler_worker.backends.base import Backend
from compiler_worker.backends.tensorrt.backend import (
    TensorRTBackend,
    profile_shapes,
)
from kiln.examples import mlp
from schemas.errors import BackendUnavailable, InvalidOptions
from schemas.fingerprint import AcceleratorInfo, CpuInfo, HardwareFingerprint, RuntimeVersions
from schemas.options import CompileOptions, Precision, ShapeProfile

TRT = TensorRTBackend()


def gpu_fp(name: str = "NVIDIA H100 80GB HBM3", cc: str = "9.0", trt: str | None = "10.3.0",
           *, accelerators: bool = True) -> HardwareFingerprint:
    return HardwareFingerprint(
        cpu=CpuInfo(arch="x86_64"),
        accelerators=[AcceleratorInfo(name=name, compute_capability=cc, memory_bytes=80 << 30)]
        if accelerators else [],
        runtimes=RuntimeVersions(onnxruntime="1.32.0", tensorrt=trt, cuda="12.4"),
    )


H100 = gpu_fp()
A100 = gpu_fp("NVIDIA A100-SXM4-80GB", "8.0")
A10 = gpu_fp("NVIDIA A10", "8.6")
A10G = gpu_fp("NVIDIA A10G", "8.6")
T4 = gpu_fp("Tesla T4", "7.5")


def test_key() -> None:
    assert TRT.fingerprint_key(H100) == "trt-sm90-nvidia-h100-80gb-hbm3-trt10.3"
    assert TRT.fingerprint_key(A100) == "trt-sm80-nvidia-a100-sxm4-80gb-trt10.3"
    assert TRT.fingerprint_key(gpu_fp(trt="10.3.1.5")) == TRT.fingerprint_key(H100)


def test_supports_needs_cuda_device_and_tensorrt() -> None:
    assert TRT.supports(H100)
    assert not TRT.supports(gpu_fp(accelerators=False))
    assert not TRT.supports(gpu_fp(trt=None))
    assert not TRT.supports(gpu_fp(cc=""))
    with pytest.raises(BackendUnavailable, match="needs a CUDA accelerator"):
        TRT.fingerprint_key(gpu_fp(trt=None))


@pytest.mark.parametrize(
    ("built", "node", "config", "expected"),
    [
        (H100, gpu_fp(), None, True),  # same key
        (A10, A10G, None, False),  # same compute capability, different GPU: plan is specific
        (A10, A10G, {"hardware_compatibility_level": "same_compute_capability"}, True),
        (A10, H100, {"hardware_compatibility_level": "same_compute_capability"}, False),
        (A100, H100, {"hardware_compatibility_level": "ampere_plus"}, True),
        (A100, T4, {"hardware_compatibility_level": "ampere_plus"}, False),
        (H100, gpu_fp(trt="10.4.0"), None, False),  # other TensorRT minor
        (H100, gpu_fp(trt="10.4.0"), {"version_compatible": True}, True),
        (gpu_fp(trt="10.4.0"), H100, {"version_compatible": True}, False),  # never older
        (gpu_fp(trt="8.5.3"), gpu_fp(trt="8.6.1"), {"version_compatible": True}, False),
        (H100, gpu_fp(accelerators=False), None, False),
    ],
)
def test_compatible(built, node, config, expected) -> None:
    assert TRT.compatible(built, node, config) is expected


def test_profiles_from_options() -> None:
    options = CompileOptions(shapes={
        "tokens": ShapeProfile(min=[1, 16], opt=[4, 128], max=[8, 512]),
        "image": ShapeProfile(min=[1, 3, 224, 224], opt=[1, 3, 224, 224], max=[1, 3, 224, 224]),
    })
    profiles = profile_shapes(
        [("tokens", (-1, -1)), ("image", (1, 3, 224, 224)), ("scale", (1,))], options
    )
    assert profiles == {"tokens": ((1, 16), (4, 128), (8, 512))}  # static inputs get none


@pytest.mark.parametrize(
    ("inputs", "shapes", "message"),
    [
        ([("x", (-1, 64))], {}, r"dynamic shape \[-1, 64\]; TensorRT needs options.shapes"),
        ([("x", (-1, 64))], {"x": ShapeProfile(min=[1], opt=[2], max=[4])}, "has rank 1"),
        ([("x", (-1, 64))], {"x": ShapeProfile(min=[1, 32], opt=[2, 64], max=[4, 64])},
         "must keep dimension 1 at 64"),
        ([("x", (-1, 64))], {"y": ShapeProfile(min=[1], opt=[1], max=[1])},
         r"names \['y'\], which are not inputs"),
    ],
)
def test_bad_profiles_are_invalid_options(inputs, shapes, message) -> None:
    with pytest.raises(InvalidOptions, match=message):
        profile_shapes(inputs, CompileOptions(shapes=shapes))


@pytest.mark.parametrize(
    ("level", "budget", "expected"), [(0, 300, [0]), (1, 300, [2]), (2, 300, [3]),
                                      (3, 300, [3, 5]), (None, 300, [3, 5]), (None, 60, [3])]
)
def test_candidates_map_levels_and_budget(level: int | None, budget: float,
                                          expected: list[int]) -> None:
    options = CompileOptions(optimization_level=level, tuning_budget_s=budget)
    found = TRT.candidates(H100, options)
    assert [c.config["builder_optimization_level"] for c in found] == expected
    assert {c.precision for c in found} == {"fp32"}


def test_candidates_follow_the_precision_policy() -> None:
    auto = TRT.candidates(H100, CompileOptions(precision="auto", tuning_budget_s=60))
    assert [c.precision for c in auto] == ["fp32", "fp16", "bf16", "int8"]
    assert auto[-1].skip and not any(c.skip for c in auto[:-1])
    assert [c.precision for c in TRT.candidates(H100, CompileOptions(precision="fp16"))] == \
        ["fp16", "fp16"]


def test_runtime_config_and_timing_cache_path(tmp_path: Path) -> None:
    backend = TensorRTBackend(timing_cache_dir=tmp_path)
    candidate = backend.candidates(H100, CompileOptions(precision=Precision.FP16,
                                                        portability="portable"))[0]
    config = backend.runtime_config(candidate, {"x": ((1, 4), (2, 4), (8, 4))})
    assert config["precision"] == "fp16"
    assert config["hardware_compatibility_level"] == "ampere_plus"
    assert config["version_compatible"] is True
    assert config["profiles"] == {"x": [[1, 4], [2, 4], [8, 4]]}
    expected_cache = tmp_path / "trt-sm90-nvidia-h100-80gb-hbm3-trt10.3.cache"
    assert backend.timing_cache_path(H100) == expected_cache
    assert TRT.timing_cache_path(H100) is None


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None,
                    reason="TensorRT is installed here")
def test_build_without_tensorrt_is_backend_unavailable(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(mlp(), path)
    with pytest.raises(BackendUnavailable, match="TensorRT is not installed"):
        TRT.build(path, CompileOptions(), tmp_path / "out", fingerprint=H100)
    with pytest.raises(BackendUnavailable, match="TensorRT is not installed"):
        TRT.toolchain()


def test_tensorrt_has_the_same_unit_shape_as_the_other_backends() -> None:
    """Same surface as onnxruntime and AOTInductor: candidates, check_options, the _build
    signature, and the model formats it takes (ONNX). No TensorRT build ever ran here."""
    import inspect

    from compiler_worker.backends import AOTInductorBackend, OnnxRuntimeBackend, TensorRTBackend

    assert TensorRTBackend.model_formats == frozenset({"onnx"})
    build = inspect.signature(TensorRTBackend._build).parameters
    for other in (AOTInductorBackend, OnnxRuntimeBackend):
        assert list(inspect.signature(other._build).parameters) == list(build)
        for method in ("candidates", "check_options", "toolchain"):
            assert getattr(TensorRTBackend, method) is not getattr(Backend, method)

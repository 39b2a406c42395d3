"""Sample inputs for health checks, and fingerprint keys computed on the agent."""

from __future__ import annotations

import numpy as np
import pytest

from compiler_worker.backends import (
    AOTInductorBackend,
    IreeBackend,
    OnnxRuntimeBackend,
    OpenVinoBackend,
)
from runtime_agent.executors import OnnxRuntimeExecutor, node_fingerprint_keys
from runtime_agent.fingerprint import detect_fingerprint
from runtime_agent.samples import INT_HIGH, sample_inputs
from schemas.errors import InvalidModel, InvalidRequest
from schemas.fingerprint import CpuInfo, HardwareFingerprint, RuntimeVersions
from schemas.manifest import TensorSpec

SPECS = [TensorSpec(name="x", dtype="float32", shape=["N", 4]),
         TensorSpec(name="ids", dtype="int64", shape=["B", "S"]),
         TensorSpec(name="mask", dtype="bool", shape=[2]),
         TensorSpec(name="h", dtype="bfloat16", shape=[3])]


def test_sample_inputs_are_seeded_and_shaped() -> None:
    a = sample_inputs(SPECS, {"ids": [2, 5]}, seed=4)
    b = sample_inputs(SPECS, {"ids": [2, 5]}, seed=4)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["x"], sample_inputs(SPECS, seed=5)["x"])
    assert a["x"].shape == (1, 4) and a["x"].dtype == np.float32  # dynamic → 1
    assert a["ids"].shape == (2, 5) and a["ids"].min() >= 0 and a["ids"].max() < INT_HIGH
    assert a["mask"].dtype == np.bool_ and a["h"].dtype.name == "bfloat16"
    assert sample_inputs(SPECS)["ids"].shape == (1, 1)


def test_sample_inputs_refuse_what_they_cannot_draw() -> None:
    with pytest.raises(InvalidRequest, match=r"sample shape \[3, 5\] for input 'x' does not fit"):
        sample_inputs(SPECS, {"x": [3, 5]})
    with pytest.raises(InvalidRequest, match="unknown rank"):
        sample_inputs([TensorSpec(name="t", dtype="float32", shape=["..."])])
    with pytest.raises(InvalidModel, match="cannot generate random inputs"):
        sample_inputs([TensorSpec(name="s", dtype="object", shape=[1])])


def test_the_agent_computes_the_keys_the_compiler_builds_for() -> None:
    fingerprint = detect_fingerprint()
    keys = node_fingerprint_keys(fingerprint)
    assert keys == {name: backend.fingerprint_key(fingerprint)
                    for name, backend in (("onnxruntime", OnnxRuntimeBackend()),
                                          ("aotinductor", AOTInductorBackend()),
                                          ("openvino", OpenVinoBackend()),
                                          ("iree", IreeBackend()))
                    if backend.supports(fingerprint)}
    assert "onnxruntime" in keys
    riscv = HardwareFingerprint(cpu=CpuInfo(arch="riscv64"),
                                runtimes=RuntimeVersions(onnxruntime="1.32.0"))
    assert node_fingerprint_keys(riscv) == {}
    assert OnnxRuntimeExecutor.compatible(fingerprint, fingerprint, {"optimization_level": 3})

"""``compatible()`` agrees with the keys, for every pair of table fingerprints.

For each backend, each build setting and each ordered pair (build host, node) of the real
fingerprints in ``tests/runtime_agent/fingerprints_table.py`` (GPU nodes also under other
TensorRT versions, CPU nodes under another onnxruntime):

    compatible(built_on, node, runtime_config)
        ⇔ exact keys equal, or (the engine's compatibility key is not None and is one of the
          node's compatibility keys)

which is what the control plane's ``compatible`` tier relies on: it matches keys in SQL, while
agents check ``compatible()`` before loading.
"""

from __future__ import annotations

from functools import cache
from itertools import product

import pytest

from compiler_worker.backends import (
    AOTInductorBackend,
    Backend,
    Candidate,
    OnnxRuntimeBackend,
    TensorRTBackend,
)
from runtime_agent.executors import node_compatibility_keys, node_fingerprint_keys
from schemas.fingerprint import HardwareFingerprint
from schemas.options import CompileOptions
from tests.runtime_agent.fingerprints_table import (
    GPU_NODES,
    TABLE,
    with_onnxruntime,
    with_tensorrt,
)
from tests.runtime_agent.test_aotinductor_keys import with_torch

TRT_VERSIONS = ["8.5.3", "8.6.1", "10.0.1", "10.2.0", "10.3.0", "10.5.1", "11.0.0"]
CPU_POPULATION = [e.fingerprint for e in TABLE.values()] + [
    with_onnxruntime(e.fingerprint, "1.21.0") for e in TABLE.values()]
GPU_POPULATION = [with_tensorrt(e.fingerprint, v) for e in GPU_NODES.values() for v in TRT_VERSIONS]

#: Every table node under three torch builds (CPU, CUDA 12.8, a CUDA build of another minor).
AOTI_POPULATION = [with_torch(e.fingerprint, v) for e in TABLE.values()
                   for v in ("2.13.0+cpu", "2.13.0+cu128", "2.12.1+cu126")]

ORT_CONFIGS = [  # as OnnxRuntimeBackend writes them, plus a manifest without a level
    (CompileOptions(optimization_level=n),
     {"graph_optimization_level": 0, "optimization_level": n,
      "providers": ["CPUExecutionProvider"]})
    for n in range(4)
] + [(CompileOptions(optimization_level=3), {"graph_optimization_level": 0})]
TRT_CONFIGS = [  # as TensorRTBackend writes them, for every portability setting
    (CompileOptions(), TensorRTBackend().runtime_config(Candidate(
        name="c", config={"hardware_compatibility_level": hw, "version_compatible": vc}), {}))
    for hw, vc in product(["none", "ampere_plus", "same_compute_capability"], [False, True])
] + [(CompileOptions(), {"hardware_compatibility_level": "bogus", "version_compatible": True})]


AOTI_CONFIGS = [  # as AOTInductorBackend writes them, plus a manifest without a device
    (CompileOptions(), {"device": "cpu", "isa_class": level, "cross_built": False})
    for level in ("x86-64", "x86-64-v2", "x86-64-v3", "x86-64-v4")
] + [(CompileOptions(), {"device": "cuda", "compute_capability": "9.0"}), (CompileOptions(), {})]


@cache
def _node_keys(index: int, population: str) -> tuple[dict[str, str], dict[str, list[str]]]:
    fp = {"cpu": CPU_POPULATION, "gpu": GPU_POPULATION, "aoti": AOTI_POPULATION}[population][index]
    return node_fingerprint_keys(fp), node_compatibility_keys(fp)


def _check_agreement(backend: Backend, population: list[HardwareFingerprint], name: str,
                     configs) -> tuple[int, int]:
    compatible_pairs = checked = 0
    for built, (j, node), (_options, config) in product(
            population, enumerate(population), configs):
        if not backend.supports(built):
            continue
        exact_keys, compat_keys = _node_keys(j, name)
        key = backend.compatibility_key(built, config)
        by_keys = exact_keys.get(backend.name) == backend.fingerprint_key(built) or (
            key is not None and key in compat_keys.get(backend.name, []))
        assert backend.compatible(built, node, config) is by_keys, (
            f"{backend.name}: built on {built.model_dump(include={'cpu', 'accelerators'})}, "
            f"node {node.model_dump(include={'cpu', 'accelerators'})}, config {config}, "
            f"compatibility key {key}")
        compatible_pairs += by_keys
        checked += 1
    return compatible_pairs, checked


def test_onnxruntime_compatible_agrees_with_keys() -> None:
    compatible_pairs, checked = _check_agreement(
        OnnxRuntimeBackend(), CPU_POPULATION, "cpu", ORT_CONFIGS)
    assert 0 < compatible_pairs < checked


def test_tensorrt_compatible_agrees_with_keys() -> None:
    compatible_pairs, checked = _check_agreement(
        TensorRTBackend(), GPU_POPULATION, "gpu", TRT_CONFIGS)
    assert 0 < compatible_pairs < checked


def test_aotinductor_compatible_agrees_with_keys() -> None:
    compatible_pairs, checked = _check_agreement(
        AOTInductorBackend(), AOTI_POPULATION, "aoti", AOTI_CONFIGS)
    assert 0 < compatible_pairs < checked


@pytest.mark.parametrize(
    ("hardware", "vc", "expected"),
    [("none", False, None), ("ampere_plus", False, "trt-ampere-plus-x86-64-trt10.3"),
     ("same_compute_capability", True, "trt-sm80-x86-64-trt10.3-vc")],
)
def test_tensorrt_backend_records_the_key_of_its_setting(hardware: str, vc: bool,
                                                         expected: str | None) -> None:
    backend = TensorRTBackend()
    a100 = GPU_NODES["a100-sxm4-80gb"].fingerprint
    config = backend.runtime_config(Candidate(name="c", config={
        "hardware_compatibility_level": hardware, "version_compatible": vc}), {})
    assert backend.compatibility_key(a100, config) == expected


def test_tensorrt_portability_option_builds_portable_plans() -> None:
    backend = TensorRTBackend()
    h100 = GPU_NODES["h100-sxm-80gb"].fingerprint
    exact = backend.candidates(h100, CompileOptions())
    portable = backend.candidates(h100, CompileOptions(portability="portable"))
    assert all(backend.compatibility_key(h100, backend.runtime_config(c, {})) is None
               for c in exact)
    assert {backend.compatibility_key(h100, backend.runtime_config(c, {})) for c in portable} \
        == {"trt-ampere-plus-x86-64-trt10.3-vc"} == {backend.portable_key(h100)}


def test_onnxruntime_backend_key_follows_the_built_level() -> None:
    epyc = TABLE["epyc-7742-zen2"].fingerprint
    backend = OnnxRuntimeBackend()
    assert backend.compatibility_key(epyc, {"optimization_level": 2}) == \
        "ort-cpu-x86-64-portable-ort1.20"
    assert backend.compatibility_key(epyc, {"optimization_level": 3}) is None
    assert backend.compatibility_key(epyc, {}) is None  # unknown level: hardware-specific
    portable = backend.candidates(epyc, CompileOptions(portability="portable"))
    assert portable and all(c.portable and c.config["optimization_level"] < 3 for c in portable)


def test_portable_keys_are_what_portable_builds_record() -> None:
    from compiler_worker.worker import fingerprint_keys, portable_keys

    h100 = GPU_NODES["h100-sxm-80gb"].fingerprint
    ort = OnnxRuntimeBackend()
    assert ort.portable_key(h100) == ort.compatibility_key(h100, {"optimization_level": 2})
    trt = TensorRTBackend()
    assert trt.portable_key(h100) == "trt-ampere-plus-x86-64-trt10.3-vc"
    assert trt.portable_key(TABLE["epyc-7742-zen2"].fingerprint) is None
    # Each key is followed by its own tuning context's (``Backend.context_key``).
    keys = fingerprint_keys(h100)
    assert keys[::2] == ["trt-sm90-nvidia-h100-80gb-hbm3-trt10.3", "ort-cpu-x86-64-v4-ort1.20"]
    assert keys[1::2] == [trt.context_key(h100), ort.context_key(h100)]
    assert portable_keys(h100) == {
        "trt-sm90-nvidia-h100-80gb-hbm3-trt10.3": "trt-ampere-plus-x86-64-trt10.3-vc",
        "ort-cpu-x86-64-v4-ort1.20": "ort-cpu-x86-64-portable-ort1.20"}

"""Keys, ISA classes and compatibility for the fingerprints of real machines."""

from __future__ import annotations

import re

import pytest

from runtime_agent.executors import (
    OnnxRuntimeExecutor,
    TensorRTExecutor,
    node_compatibility_keys,
    node_fingerprint_keys,
)
from runtime_agent.executors.tensorrt.executor import is_integrated
from runtime_agent.fingerprint import isa_class
from tests.runtime_agent.fingerprints_table import (
    GPU_NODES,
    TABLE,
    Entry,
    fingerprint,
    with_onnxruntime,
    with_tensorrt,
)

KEY = re.compile(r"^[a-z0-9][a-z0-9.-]{0,199}$")  # queue names and the SQL key column
ORT, TRT = OnnxRuntimeExecutor, TensorRTExecutor


def level(n: int) -> dict[str, object]:
    return {"graph_optimization_level": 0, "optimization_level": n,
            "providers": ["CPUExecutionProvider"]}


def trt_config(hardware: str = "none", vc: bool = False) -> dict[str, object]:
    return {"hardware_compatibility_level": hardware, "version_compatible": vc}


@pytest.mark.parametrize("name", list(TABLE))
def test_isa_class_and_keys(name: str) -> None:
    entry: Entry = TABLE[name]
    fp = entry.fingerprint
    assert isa_class(fp.cpu) == entry.isa_class
    assert ORT.fingerprint_key(fp) == entry.ort_key
    portable = f"ort-cpu-{'x86-64' if fp.cpu.arch == 'x86_64' else 'aarch64'}-portable-ort1.20"
    keys = node_fingerprint_keys(fp)
    compat = node_compatibility_keys(fp)
    assert keys.get("tensorrt") == entry.trt_key
    assert keys["onnxruntime"] == entry.ort_key
    assert compat["onnxruntime"] == [portable]
    for key in [*keys.values(), *(k for ks in compat.values() for k in ks)]:
        assert KEY.match(key), key
    if entry.trt_key is not None:
        assert TRT.supports(fp) and is_integrated(fp.accelerators[0]) is entry.integrated_gpu


def test_cpu_features_follow_the_public_specifications() -> None:
    assert "avx512f" not in fingerprint("epyc-7742-zen2").cpu.features
    assert {"avx2", "fma", "bmi2"} <= set(fingerprint("epyc-7742-zen2").cpu.features)
    icelake = set(fingerprint("xeon-8380-icelake").cpu.features)
    assert {"avx512f", "avx512cd", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni"} <= icelake
    assert not icelake & {"avx512_bf16", "amx_tile", "avx_vnni"}
    spr = set(fingerprint("xeon-8480-sapphire-rapids").cpu.features)
    assert {"avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8"} <= spr
    graviton3 = fingerprint("graviton3-neoverse-v1").cpu
    assert set(graviton3.features) == {"neon", "fp16", "dotprod", "sve", "i8mm", "bf16"}
    assert graviton3.model == "Neoverse-V1"
    assert fingerprint("graviton2-neoverse-n1").cpu.features == ["dotprod", "fp16", "neon"]
    assert "sve2" in fingerprint("gh200").cpu.features
    orin = fingerprint("jetson-agx-orin-64gb")
    assert orin.cpu.model == "Cortex-A78AE" and "sve" not in orin.cpu.features


@pytest.mark.parametrize(
    ("built", "node", "config", "expected"),
    [
        ("xeon-8380-icelake", "epyc-7742-zen2", level(3), False),  # v4 NCHWc on AVX2-only
        ("xeon-8380-icelake", "epyc-7742-zen2", level(1), True),  # portable level
        ("xeon-8380-icelake", "xeon-8480-sapphire-rapids", level(3), True),  # same class
        ("epyc-7742-zen2", "xeon-8380-icelake", level(3), False),  # different key, not portable
        ("graviton3-neoverse-v1", "xeon-8380-icelake", level(0), False),  # never across arch
        ("graviton3-neoverse-v1", "graviton2-neoverse-n1", level(3), False),  # SVE kernels
        ("graviton3-neoverse-v1", "graviton2-neoverse-n1", level(2), True),
        ("graviton2-neoverse-n1", "jetson-agx-orin-64gb", level(3), True),  # both dotprod
    ],
)
def test_onnxruntime_compatibility(built: str, node: str, config, expected: bool) -> None:
    assert ORT.compatible(fingerprint(built), fingerprint(node), config) is expected


def test_onnxruntime_needs_the_same_minor_version() -> None:
    other = with_onnxruntime(fingerprint("epyc-7742-zen2"), "1.21.0")
    assert not ORT.compatible(fingerprint("xeon-8380-icelake"), other, level(1))
    assert ORT.compatibility_key(fingerprint("xeon-8380-icelake"), level(1)) not in \
        ORT.compatibility_keys(other)


@pytest.mark.parametrize(
    ("built", "node", "config", "expected"),
    [
        ("h100-sxm-80gb", "a100-sxm4-80gb", trt_config(), False),  # a default plan is specific
        ("h100-sxm-80gb", "a100-sxm4-80gb", trt_config("ampere_plus"), True),
        ("a100-sxm4-80gb", "h100-sxm-80gb", trt_config("ampere_plus"), True),
        ("a100-sxm4-40gb", "a100-sxm4-80gb", trt_config(), False),  # another GPU model
        ("a100-sxm4-40gb", "a100-sxm4-80gb", trt_config("same_compute_capability"), True),
        ("l4", "a100-sxm4-80gb", trt_config("same_compute_capability"), False),
        ("l4", "t4", trt_config("ampere_plus"), False),  # Turing is not Ampere+
        ("a100-sxm4-80gb", "jetson-agx-orin-64gb", trt_config("ampere_plus"), False),  # JetPack
        ("jetson-agx-orin-64gb", "jetson-agx-orin-64gb", trt_config(), True),  # exact key
        ("h100-sxm-80gb", "gh200", trt_config("ampere_plus"), False),  # x86 plan, Arm host
        ("h100-sxm-80gb", "gh200", trt_config("same_compute_capability"), False),
        ("l4", "h100-sxm-80gb", trt_config("ampere_plus", vc=True), True),
        ("h100-sxm-80gb", "l4", trt_config("bogus_level"), False),  # unknown: exact key only
    ],
)
def test_tensorrt_compatibility(built: str, node: str, config, expected: bool) -> None:
    assert TRT.compatible(fingerprint(built), fingerprint(node), config) is expected


def test_tensorrt_version_compatibility_is_within_one_major() -> None:
    h100 = fingerprint("h100-sxm-80gb")
    vc = trt_config(vc=True)
    assert TRT.compatible(h100, with_tensorrt(h100, "10.5.1"), vc)
    assert not TRT.compatible(h100, with_tensorrt(h100, "10.5.1"), trt_config())
    assert not TRT.compatible(with_tensorrt(h100, "10.5.1"), h100, vc)  # never older
    assert not TRT.compatible(with_tensorrt(h100, "8.6.1"), h100, vc)  # not across majors
    assert not TRT.compatible(with_tensorrt(h100, "8.5.3"), with_tensorrt(h100, "8.6.1"), vc)
    assert TRT.compatible(with_tensorrt(h100, "8.6.1"), with_tensorrt(h100, "8.6.3"), vc)


def test_tensorrt_keys() -> None:
    h100, orin, t4 = (fingerprint(n) for n in ("h100-sxm-80gb", "jetson-agx-orin-64gb", "t4"))
    assert TRT.compatibility_key(h100, trt_config()) is None
    assert TRT.compatibility_key(h100, trt_config("ampere_plus")) == \
        "trt-ampere-plus-x86-64-trt10.3"
    assert TRT.compatibility_key(h100, trt_config("same_compute_capability")) == \
        "trt-sm90-x86-64-trt10.3"
    assert TRT.compatibility_key(h100, trt_config(vc=True)) == \
        "trt-sm90-nvidia-h100-80gb-hbm3-x86-64-trt10.3-vc"
    assert TRT.compatibility_key(orin, trt_config(vc=True)) is None
    assert TRT.compatibility_key(t4, trt_config("same_compute_capability")) is None
    keys = TRT.compatibility_keys(h100)
    assert keys[:2] == ["trt-sm90-x86-64-trt10.3", "trt-ampere-plus-x86-64-trt10.3"]
    assert "trt-ampere-plus-x86-64-trt10.0-vc" in keys and len(keys) == 2 + 4 * 3
    assert TRT.compatibility_keys(orin) == []  # no hardware compatibility on JetPack
    assert TRT.compatibility_keys(t4) == [f"trt-sm75-tesla-t4-x86-64-trt10.{m}-vc"
                                          for m in range(4)]
    assert TRT.compatibility_keys(with_tensorrt(h100, "8.5.3")) == []
    assert len(TRT.compatibility_keys(with_tensorrt(h100, "8.6.1"))) == 2 + 3


def test_every_gpu_node_has_a_distinct_exact_key() -> None:
    keys = [entry.trt_key for entry in GPU_NODES.values()]
    assert len(set(keys)) == len(keys)
    assert {e.fingerprint.accelerators[0].sm_count for e in GPU_NODES.values()} == \
        {132, 108, 58, 40, 16}

"""Requirements and tuning context as pure rules: what a node must have to run an engine,
where it differs in what decided the winner, and which declared fingerprints no CPU has."""

from __future__ import annotations

import pytest

from runtime_agent.executors import OnnxRuntimeExecutor
from schemas.fingerprint import (
    CpuInfo,
    EngineRequirements,
    HardwareFingerprint,
    context_differences,
    core_class,
    fingerprint_inconsistencies,
    unmet_requirements,
)
from tests.runtime_agent.fingerprints_table import CASCADE_LAKE_FLAGS, SAPPHIRE_RAPIDS_FLAGS

V3 = ["ssse3", "sse4_1", "sse4_2", "popcnt", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2"]
V4 = [*V3, "avx512f", "avx512cd", "avx512dq", "avx512bw", "avx512vl"]


def fp(features, *, arch="x86_64", cores=8, ort="1.32.0") -> HardwareFingerprint:
    return HardwareFingerprint(cpu=CpuInfo(arch=arch, features=list(features), cores=cores),
                               runtimes={"onnxruntime": ort})


def test_an_int8_engine_without_reduce_range_built_with_vnni_requires_it():
    vnni_host = fp([*V4, "avx512_vnni"])
    config = {"optimization_level": 3, "quantize": "static-qdq", "reduce_range": False}
    req = OnnxRuntimeExecutor.requirements(vnni_host, config, "int8-static-qdq")
    assert req.features == ["avx512_vnni|avx_vnni|amx_int8"]
    assert req.isa_level == "x86-64-v4" and req.runtimes == {"onnxruntime": "1.32"}
    # A Skylake-SP (x86-64-v4, no VNNI: onnxruntime#5849's Gold 5118) lacks it ...
    assert unmet_requirements(req, fp(V4)) == [
        "CPU feature(s) avx512_vnni or avx_vnni or amx_int8"]
    # ... an AVX-VNNI client CPU of the same level has one.
    assert unmet_requirements(req, fp([*V4, "avx_vnni"])) == []
    # With reduce_range the engine never relied on VNNI.
    kept = OnnxRuntimeExecutor.requirements(vnni_host, {**config, "reduce_range": True},
                                            "int8-static-qdq")
    assert kept.features == [] and unmet_requirements(kept, fp(V4)) == []


def test_an_fp32_engine_requires_no_feature_and_a_portable_one_no_level():
    host = fp(V3)
    level3 = OnnxRuntimeExecutor.requirements(host, {"optimization_level": 3}, "fp32")
    assert level3.features == [] and level3.isa_level == "x86-64-v3"
    assert unmet_requirements(level3, fp(V4)) == []  # a higher level holds the lower's
    assert unmet_requirements(level3, fp(V3[:4])) == ["ISA level x86-64-v3 (the node is "
                                                      "x86-64-v2)"]
    portable = OnnxRuntimeExecutor.requirements(host, {"optimization_level": 2}, "fp32")
    assert portable.isa_level is None and unmet_requirements(portable, fp(V3[:4])) == []
    assert unmet_requirements(portable, fp(["neon"], arch="aarch64")) == [
        "architecture x86_64 (the node is aarch64)"]
    assert unmet_requirements(portable, fp(V3, ort="1.31.1")) == [
        "onnxruntime 1.32 (the node has 1.31.1)"]


def test_bf16_and_gpu_and_key_requirements():
    req = EngineRequirements(arch="x86_64", features=["amx_bf16|avx512_bf16"],
                             compute_capability="9.0", key="k-1")
    unmet = unmet_requirements(req, fp(V4), "k-2")
    assert unmet == ["CPU feature(s) amx_bf16 or avx512_bf16",
                     "a GPU of compute capability 9.0 (the node has none)",
                     "fingerprint key k-1 (the node's is k-2)"]


def test_only_what_decided_the_winner_is_a_difference():
    host = fp([*V4, "avx512_vnni"], cores=2)
    fp32 = OnnxRuntimeExecutor.tuning_context(host, {}, "fp32", threads_tuned=True)
    assert fp32.depends_on == [] and fp32.core_class == "c1-4"
    assert context_differences(fp32, fp(V4, cores=4)) == []  # VNNI never raced for fp32
    assert context_differences(fp32, fp(V4, cores=64)) == [
        "cores 64 (c17-64; tuned for c1-4)"]
    auto = OnnxRuntimeExecutor.tuning_context(host, {}, "auto", threads_tuned=True)
    assert context_differences(auto, fp(V4, cores=2)) == ["no avx512_vnni"]
    untuned = OnnxRuntimeExecutor.tuning_context(host, {}, "fp32", threads_tuned=False)
    assert context_differences(untuned, fp(V4, cores=64)) == []
    assert [core_class(n) for n in (1, 4, 5, 16, 17, 64, 65)] == [
        "c1-4", "c1-4", "c5-16", "c5-16", "c17-64", "c17-64", "c65+"]


@pytest.mark.parametrize(("features", "arch", "needle"), [
    (["neon", "amx_tile"], "aarch64", "x86 feature(s) ['amx_tile'] on an aarch64 CPU"),
    (["avx512f", "avx2"], "x86_64", "x86-64-v4 feature(s) ['avx512f'] without the baseline"),
    (["amx_bf16", *V4], "x86_64", "amx_bf16 without amx_tile"),
    ([*V3, "avx512_vnni"], "x86_64", "avx512_vnni without avx512f"),
    (["neon", *V3], "x86_64", "Arm feature(s) ['neon'] on an x86_64 CPU"),
])
def test_inconsistent_fingerprints_are_named(features, arch, needle):
    problems = fingerprint_inconsistencies(fp(features, arch=arch))
    assert any(needle in p for p in problems), problems


def test_real_cpus_are_consistent():
    for flags in (CASCADE_LAKE_FLAGS, SAPPHIRE_RAPIDS_FLAGS):
        from runtime_agent.fingerprint import parse_cpuinfo

        _, _, features = parse_cpuinfo(f"flags : {flags}\n", "x86_64")
        assert fingerprint_inconsistencies(fp(features)) == []
    assert fingerprint_inconsistencies(fp(["neon", "fp16", "dotprod"], arch="aarch64")) == []


def test_a_runtime_is_matched_on_its_numeric_release():
    """The default rule records the build host's runtime as it reports itself ("2.13.0+cpu"
    for torch's CPU wheel); the same release on the node meets it, another does not."""
    req = EngineRequirements(arch="x86_64", runtimes={"torch": "2.13.0+cpu"})
    node = HardwareFingerprint(cpu=CpuInfo(arch="x86_64", features=V3, cores=2),
                               runtimes={"torch": "2.13.0+cpu"})
    assert unmet_requirements(req, node) == []
    older = node.model_copy(update={"runtimes": {"torch": "2.12.1+cpu"}})
    assert unmet_requirements(req, older) == ["torch 2.13.0+cpu (the node has 2.12.1+cpu)"]
    minor = EngineRequirements(arch="x86_64", runtimes={"onnxruntime": "1.32"})
    assert unmet_requirements(minor, fp(V3, ort="1.32.0")) == []
    assert unmet_requirements(minor, fp(V3, ort="1.33.0")) != []

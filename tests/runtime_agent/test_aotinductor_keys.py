"""AOTInductor keys and compatibility: pure logic over declared fingerprints (CPU and CUDA).

The CUDA rules run here on the table's H100/A100/GH200 fingerprints with a declared CUDA build
of torch; no GPU is needed (and none has run a CUDA AOTInductor engine for Kiln yet).
"""

from __future__ import annotations

import pytest

from runtime_agent.executors import AOTInductorExecutor as AOTI
from runtime_agent.executors import node_compatibility_keys, node_fingerprint_keys
from runtime_agent.executors.aotinductor.executor import cuda_target, torch_cuda_version
from runtime_agent.fingerprint import older_variant
from schemas.errors import BackendUnavailable
from schemas.fingerprint import HardwareFingerprint
from tests.runtime_agent.fingerprints_table import TABLE, fingerprint


def with_torch(fp: HardwareFingerprint, version: str | None) -> HardwareFingerprint:
    return fp.model_copy(update={"runtimes": {**fp.runtimes, "torch": version}})


def test_torch_cuda_version_reads_the_local_tag() -> None:
    assert torch_cuda_version("2.9.0+cu128") == (12, 8)
    assert torch_cuda_version("2.4.1+cu118") == (11, 8)
    assert torch_cuda_version("2.10.0+cu130") == (13, 0)
    assert torch_cuda_version("2.13.0+cpu") is None
    assert torch_cuda_version("2.13.0") is None
    assert torch_cuda_version(None) is None


@pytest.mark.parametrize(("name", "key"), [
    ("h100-sxm-80gb", "aoti-sm90-cuda12-torch2.9-drv550-x86-64"),
    ("a100-sxm4-80gb", "aoti-sm80-cuda12-torch2.9-drv550-x86-64"),
    ("l4", "aoti-sm89-cuda12-torch2.9-drv550-x86-64"),
    ("gh200", "aoti-sm90-cuda12-torch2.9-drv550-aarch64"),
])
def test_cuda_keys(name: str, key: str) -> None:
    fp = with_torch(fingerprint(name), "2.9.0+cu128")
    assert AOTI.supports(fp)
    assert AOTI.fingerprint_key(fp) == key == node_fingerprint_keys(fp)["aotinductor"]
    assert AOTI.compatibility_keys(fp) == []
    assert AOTI.compatibility_key(fp, {"device": "cuda", "compute_capability": "9.0"}) is None


def test_cuda_needs_a_cuda_torch_a_driver_and_a_capability() -> None:
    h100 = fingerprint("h100-sxm-80gb")
    # A CPU build of torch on a GPU node: CPU engines for its x86-64 level.
    assert cuda_target(with_torch(h100, "2.9.0+cpu")) is None
    assert AOTI.fingerprint_key(with_torch(h100, "2.9.0+cpu")) == "aoti-cpu-x86-64-v4-torch2.9"
    with pytest.raises(BackendUnavailable, match="no CUDA target"):
        AOTI.cuda_key(with_torch(h100, "2.9.0+cpu"))
    # Jetson: no driver version in NVML's answer, and an aarch64 CPU: nothing to build.
    orin = with_torch(fingerprint("jetson-agx-orin-64gb"), "2.5.0+cu126")
    assert cuda_target(orin) is None and not AOTI.supports(orin)
    # No torch at all.
    assert not AOTI.supports(h100) and "aotinductor" not in node_fingerprint_keys(h100)
    with pytest.raises(BackendUnavailable, match=r"runtimes\.torch"):
        AOTI.fingerprint_key(h100)


def test_cuda_engines_run_only_on_their_exact_key() -> None:
    h100 = with_torch(fingerprint("h100-sxm-80gb"), "2.9.0+cu128")
    a100 = with_torch(fingerprint("a100-sxm4-80gb"), "2.9.0+cu128")
    newer_driver = h100.model_copy(deep=True)
    newer_driver.accelerators[0].driver = "570.86.10"
    config = {"device": "cuda", "compute_capability": "9.0"}
    assert AOTI.compatible(h100, h100, config)
    assert not AOTI.compatible(h100, a100, config)
    assert not AOTI.compatible(h100, with_torch(h100, "2.9.0+cu130"), config)  # CUDA 13
    assert not AOTI.compatible(h100, with_torch(h100, "2.10.0+cu128"), config)
    assert not AOTI.compatible(h100, newer_driver, config)
    assert AOTI.fingerprint_key(newer_driver).endswith("-drv570-x86-64")


def test_cpu_keys_and_the_levels_below() -> None:
    epyc = with_torch(fingerprint("epyc-7742-zen2"), "2.13.0+cpu")
    spr = with_torch(fingerprint("xeon-8480-sapphire-rapids"), "2.13.0")
    assert AOTI.fingerprint_key(epyc) == "aoti-cpu-x86-64-v3-torch2.13"
    assert AOTI.fingerprint_key(spr) == "aoti-cpu-x86-64-v4-torch2.13"
    assert node_compatibility_keys(spr)["aotinductor"] == [
        "aoti-cpu-x86-64-plus-torch2.13", "aoti-cpu-x86-64-v2-plus-torch2.13",
        "aoti-cpu-x86-64-v3-plus-torch2.13", "aoti-cpu-x86-64-v4-plus-torch2.13"]
    v3_engine = {"device": "cpu", "isa_class": "x86-64-v3"}
    assert AOTI.compatibility_key(epyc, v3_engine) == "aoti-cpu-x86-64-v3-plus-torch2.13"
    assert AOTI.compatible(epyc, spr, v3_engine)          # v4 runs v3 code
    assert not AOTI.compatible(spr, epyc, {"device": "cpu", "isa_class": "x86-64-v4"})
    assert not AOTI.compatible(epyc, with_torch(spr, "2.12.0"), v3_engine)
    # A cross-built engine: an older variant declared on a v3 host, run on the real v3 host.
    v2 = older_variant(epyc)
    v2_engine = {"device": "cpu", "isa_class": "x86-64-v2", "cross_built": True}
    assert AOTI.fingerprint_key(v2) == "aoti-cpu-x86-64-v2-torch2.13"
    assert AOTI.compatible(v2, epyc, v2_engine) and not AOTI.compatible(epyc, v2, v3_engine)
    # aarch64 CPUs get no AOTInductor CPU engines (SVE vector length and bf16 are not keyed).
    graviton3 = with_torch(TABLE["graviton3-neoverse-v1"].fingerprint, "2.13.0")
    assert not AOTI.supports(graviton3)

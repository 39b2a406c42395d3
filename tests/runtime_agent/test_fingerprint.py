"""Fingerprint detection on this machine, /proc/cpuinfo parsing, ISA classes, declared files."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import platform
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from runtime_agent.fingerprint import (
    ARM_FEATURES,
    X86_FEATURES,
    cuda_version_string,
    detect_accelerators,
    detect_fingerprint,
    isa_class,
    load_fingerprint,
    merge_fingerprint,
    normalize_arch,
    nvml_accelerators,
    parse_cpuinfo,
    resolve_fingerprint,
)
from schemas.errors import InvalidRequest
from schemas.fingerprint import CpuInfo, HardwareFingerprint

HASWELL_FLAGS = (
    "fpu vme sse sse2 ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx f16c rdrand "
    "lahf_lm abm bmi1 hle avx2 smep bmi2 erms invpcid hypervisor"
)
SKYLAKE_SP_FLAGS = HASWELL_FLAGS + " avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni"
X86_CPUINFO = f"""processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model name\t: Intel(R) Xeon(R) Gold 6248 CPU @ 2.50GHz
flags\t\t: {SKYLAKE_SP_FLAGS}

processor\t: 1
vendor_id\t: GenuineIntel
flags\t\t: fpu
"""
NEOVERSE_N1_CPUINFO = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm \
lrcpc dcpop asimddp ssbs
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x3
CPU part\t: 0xd0c
CPU revision\t: 1
"""


def test_detects_this_machine() -> None:
    import onnx
    import onnxruntime

    fp = detect_fingerprint()
    assert fp.source == "detected"
    assert fp.cpu.arch == normalize_arch(platform.machine())
    assert fp.cpu.cores == os.cpu_count()
    assert fp.cpu.memory_bytes > 0
    assert fp.cpu.features == sorted(fp.cpu.features)
    assert set(fp.cpu.features) <= X86_FEATURES | set(ARM_FEATURES.values())
    assert fp.runtimes.get("onnxruntime") == onnxruntime.__version__
    assert fp.runtimes.get("onnx") == onnx.__version__
    if importlib.util.find_spec("pynvml") is None:
        assert fp.accelerators == [] and fp.runtimes.get("cuda") is None
    assert fp.os == platform.platform()
    assert isa_class(fp.cpu).startswith(("x86-64", "armv8")) or isa_class(fp.cpu) == fp.cpu.arch
    if Path("/proc/cpuinfo").exists() and fp.cpu.arch == "x86_64":
        assert fp.cpu.vendor
        assert "sse4_2" in fp.cpu.features  # every x86-64 machine that runs onnxruntime


@pytest.mark.parametrize(
    ("machine", "arch"),
    [("x86_64", "x86_64"), ("AMD64", "x86_64"), ("arm64", "aarch64"), ("aarch64", "aarch64"),
     ("riscv64", "riscv64")],
)
def test_normalize_arch(machine: str, arch: str) -> None:
    assert normalize_arch(machine) == arch


def test_parse_x86_cpuinfo_keeps_kernel_features_of_first_processor() -> None:
    vendor, model, features = parse_cpuinfo(X86_CPUINFO, "x86_64")
    assert vendor == "GenuineIntel"
    assert model == "Intel(R) Xeon(R) Gold 6248 CPU @ 2.50GHz"
    assert "avx512_vnni" in features and "avx2" in features
    assert "hypervisor" not in features and "aes" not in features
    assert features == sorted(features)


def test_parse_arm_cpuinfo_maps_feature_names() -> None:
    vendor, model, features = parse_cpuinfo(NEOVERSE_N1_CPUINFO, "aarch64")
    assert vendor == "ARM"
    assert model == "Neoverse-N1"
    assert features == ["dotprod", "fp16", "neon"]


def _cpu(arch: str, features: str) -> CpuInfo:
    return CpuInfo(arch=arch, features=features.split())


@pytest.mark.parametrize(
    ("cpu", "expected"),
    [
        (_cpu("x86_64", SKYLAKE_SP_FLAGS), "x86-64-v4"),
        (_cpu("x86_64", HASWELL_FLAGS), "x86-64-v3"),
        # AVX-512 without the v3 base (impossible on real parts) is not v4
        (_cpu("x86_64", "avx512f avx512bw avx512vl avx512cd avx512dq"), "x86-64"),
        # AVX2 without BMI (some hypervisors mask it): not v3
        (_cpu("x86_64", "ssse3 sse4_1 sse4_2 popcnt avx avx2 fma f16c"), "x86-64-v2"),
        (_cpu("x86_64", "sse sse2"), "x86-64"),
        (_cpu("aarch64", "neon dotprod sve sve2"), "armv8-sve"),
        (_cpu("aarch64", "neon dotprod"), "armv8-dotprod"),
        (_cpu("aarch64", "neon"), "armv8"),
        (_cpu("riscv64", "v"), "riscv64"),
    ],
)
def test_isa_class(cpu: CpuInfo, expected: str) -> None:
    assert isa_class(cpu) == expected


def test_load_declared_fingerprint(tmp_path: Path) -> None:
    detected = detect_fingerprint()
    path = tmp_path / "fp.json"
    path.write_text(detected.model_dump_json())
    declared = load_fingerprint(path)
    assert declared.source == "declared"
    assert declared.cpu == detected.cpu


@pytest.mark.parametrize(
    "content",
    ["{not json", json.dumps({"cpu": {"arch": "x86_64", "flags": []}}), json.dumps([1, 2])],
)
def test_bad_fingerprint_file_is_invalid_request(tmp_path: Path, content: str) -> None:
    path = tmp_path / "fp.json"
    path.write_text(content)
    with pytest.raises(InvalidRequest, match="not a valid HardwareFingerprint"):
        load_fingerprint(path)


def test_missing_fingerprint_file_is_invalid_request(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="cannot read"):
        load_fingerprint(tmp_path / "absent.json")


# -- NVML ---------------------------------------------------------------------------------------
# A stand-in for the ``pynvml`` module, answering as NVML does on the GPUs named (datasheet
# figures). It stands in because no NVIDIA GPU or driver exists on the machines these tests
# run on; it tests Kiln's reading of NVML, not NVML, and no engine is involved. The real
# library's "no driver" path is tested below without a stand-in where nvidia-ml-py is present.


class NVMLError(Exception):
    pass


def fake_nvml(gpus: list[dict], *, attributes: bool = False, cores: bool = True,
              init_error: Exception | None = None) -> SimpleNamespace:
    def unsupported(*_: object) -> None:
        raise NVMLError("Not Supported")

    def init() -> None:
        if init_error is not None:
            raise init_error

    return SimpleNamespace(
        NVMLError=NVMLError,
        nvmlInit=init,
        nvmlShutdown=lambda: None,
        nvmlSystemGetDriverVersion=lambda: "550.54.15",
        nvmlSystemGetCudaDriverVersion=lambda: 12040,
        nvmlDeviceGetCount=lambda: len(gpus),
        nvmlDeviceGetHandleByIndex=lambda i: gpus[i],
        nvmlDeviceGetName=lambda h: h["name"].encode(),  # older pynvml returns bytes
        nvmlDeviceGetCudaComputeCapability=lambda h: h["cc"],
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(total=h["memory"], free=0, used=0),
        nvmlDeviceGetAttributes=(lambda h: SimpleNamespace(multiprocessorCount=h["sms"]))
        if attributes else unsupported,
        nvmlDeviceGetNumGpuCores=(lambda h: h["cores"]) if cores else unsupported,
    )


H100 = {"name": "NVIDIA H100 80GB HBM3", "cc": (9, 0), "memory": 85520809984, "sms": 132,
        "cores": 16896}
A100 = {"name": "NVIDIA A100-SXM4-40GB", "cc": (8, 0), "memory": 42949672960, "sms": 108,
        "cores": 6912}
L4 = {"name": "NVIDIA L4", "cc": (8, 9), "memory": 24152899584, "sms": 58, "cores": 7424}


def test_nvml_devices_are_read_in_full() -> None:
    gpus, cuda = nvml_accelerators(fake_nvml([H100, A100, L4], attributes=True))
    assert cuda == "12.4"
    assert [(g.name, g.compute_capability, g.sm_count) for g in gpus] == [
        ("NVIDIA H100 80GB HBM3", "9.0", 132), ("NVIDIA A100-SXM4-40GB", "8.0", 108),
        ("NVIDIA L4", "8.9", 58)]
    assert gpus[0].memory_bytes == H100["memory"] and gpus[0].driver == "550.54.15"
    assert {g.kind for g in gpus} == {"cuda"}


def test_sm_count_falls_back_to_cores_then_to_known_gpus() -> None:
    # nvmlDeviceGetAttributes answers only for MIG handles: full GPUs use the core count
    gpus, _ = nvml_accelerators(fake_nvml([H100, A100, L4]))
    assert [g.sm_count for g in gpus] == [132, 108, 58]
    gpus, _ = nvml_accelerators(fake_nvml([H100, {**A100, "name": "Some Future GPU"}],
                                          cores=False))
    assert [g.sm_count for g in gpus] == [132, 0]  # table by name; unknown stays 0


def test_cuda_version_string() -> None:
    assert cuda_version_string(12040) == "12.4"
    assert cuda_version_string(11080) == "11.8"
    assert cuda_version_string(None) is None


def test_no_pynvml_or_no_driver_means_no_accelerators(monkeypatch, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="runtime_agent.fingerprint")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    assert detect_accelerators() == ([], None)
    assert "not installed" in caplog.text
    monkeypatch.setitem(sys.modules, "pynvml",
                        fake_nvml([H100], init_error=NVMLError("Driver Not Loaded")))
    assert detect_accelerators() == ([], None)
    assert "Driver Not Loaded" in caplog.text
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([H100]))
    gpus, cuda = detect_accelerators()
    assert [g.name for g in gpus] == [H100["name"]] and cuda == "12.4"


def test_real_nvml_library_without_a_driver_means_no_accelerators(monkeypatch) -> None:
    """The real nvidia-ml-py (a dev dependency) on a machine with no NVIDIA driver."""
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:  # a GPU machine: detection must then find at least one device
        pynvml.nvmlShutdown()
        assert detect_accelerators()[0]
        return
    assert detect_accelerators() == ([], None)


def test_detected_fingerprint_carries_gpus_and_cuda(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([L4]))
    fp = detect_fingerprint()
    assert fp.accelerators[0].name == "NVIDIA L4" and fp.runtimes.get("cuda") == "12.4"


def test_tensorrt_version_without_metadata_reads_the_module(monkeypatch) -> None:
    from runtime_agent.executors.tensorrt import executor as trt_module
    from runtime_agent.executors.tensorrt.executor import TensorRTExecutor

    monkeypatch.setattr(trt_module, "package_version", lambda *names: None)
    monkeypatch.setattr(trt_module, "find_spec", lambda name: object())
    monkeypatch.setitem(sys.modules, "tensorrt", SimpleNamespace(__version__="10.3.0.30"))
    assert TensorRTExecutor.probe_version() == "10.3.0.30"
    monkeypatch.setattr(trt_module, "find_spec", lambda name: None)
    assert TensorRTExecutor.probe_version() is None


# -- declared fingerprints: partial files merge onto the detected one ---------------------------


def test_resolve_without_a_file_detects() -> None:
    assert resolve_fingerprint() == detect_fingerprint()


def test_partial_declaration_merges_onto_detection(tmp_path: Path) -> None:
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({
        "accelerators": [{"name": "NVIDIA L4", "compute_capability": "8.9", "sm_count": 58}],
        "runtimes": {"tensorrt": "10.3.0"},
        "source": "detected",  # ignored: a declared fingerprint says so
    }))
    detected = detect_fingerprint()
    resolved = resolve_fingerprint(path)
    assert resolved.source == "declared"
    assert resolved.cpu == detected.cpu and resolved.os == detected.os
    assert resolved.runtimes.get("onnxruntime") == detected.runtimes.get("onnxruntime")
    assert resolved.runtimes.get("tensorrt") == "10.3.0"
    assert [a.name for a in resolved.accelerators] == ["NVIDIA L4"]


def test_declaration_replaces_lists_and_merges_objects() -> None:
    base = HardwareFingerprint(cpu=CpuInfo(arch="x86_64", features=["avx2", "fma"], cores=8))
    merged = merge_fingerprint(base, {"cpu": {"features": ["sse4_2"]}, "accelerators": []})
    assert merged.cpu.features == ["sse4_2"] and merged.cpu.cores == 8


def test_complete_declaration_resolves_to_itself(tmp_path: Path) -> None:
    from runtime_agent.fingerprint import detect_runtimes

    # runtimes merge by name: a complete declaration names every runtime this machine probes
    declared = HardwareFingerprint(os="Linux", cpu=CpuInfo(arch="aarch64", features=["neon"]),
                                   runtimes={name: None for name in detect_runtimes()})
    path = tmp_path / "fp.json"
    path.write_text(declared.model_dump_json())
    assert resolve_fingerprint(path) == load_fingerprint(path)


@pytest.mark.parametrize(
    ("content", "message"),
    [("{not json", "not a valid HardwareFingerprint"),
     (json.dumps([1, 2]), "must hold a JSON object"),
     (json.dumps({"cpu": {"flags": ["avx2"]}}), "not a valid HardwareFingerprint"),
     (json.dumps({"accelerators": [{"compute_capability": "9.0"}]}), "name")],
)
def test_bad_partial_declaration_is_invalid_request(tmp_path: Path, content: str,
                                                    message: str) -> None:
    path = tmp_path / "fp.json"
    path.write_text(content)
    with pytest.raises(InvalidRequest, match=message):
        resolve_fingerprint(path)
    with pytest.raises(InvalidRequest, match="cannot read"):
        resolve_fingerprint(tmp_path / "absent.json")


def _x86(*features: str) -> HardwareFingerprint:
    return HardwareFingerprint(cpu=CpuInfo(arch="x86_64", model="Test CPU", features=features))


V2 = ("ssse3", "sse4_1", "sse4_2", "popcnt")
V3 = (*V2, "avx", "avx2", "fma", "f16c", "bmi1", "bmi2")
V4 = (*V3, "avx512f", "avx512cd", "avx512dq", "avx512bw", "avx512vl")


@pytest.mark.parametrize(("features", "expected"), [
    ((*V4, "avx512_vnni", "avx512_bf16", "amx_tile"), "x86-64-v3"),
    (V3, "x86-64-v2"),
    (V2, "x86-64"),
])
def test_older_variant_is_one_level_down(features: tuple[str, ...], expected: str) -> None:
    from runtime_agent.fingerprint import older_variant

    fp = _x86(*features)
    older = older_variant(fp)
    assert isa_class(older.cpu) == expected
    assert not {f for f in older.cpu.features if f.startswith(("avx512", "amx"))}
    assert set(older.cpu.features) < set(fp.cpu.features)  # only removals
    assert older.source == "declared" and expected in older.cpu.model
    assert fp.cpu.features == list(features)  # the original is untouched


@pytest.mark.parametrize("fp", [
    _x86("sse2"),
    HardwareFingerprint(cpu=CpuInfo(arch="aarch64", features=["neon"])),
])
def test_older_variant_refuses_what_has_no_level_below(fp: HardwareFingerprint) -> None:
    from runtime_agent.fingerprint import older_variant

    with pytest.raises(ValueError):
        older_variant(fp)


def test_the_installed_runtime_is_the_one_import_loads(tmp_path: Path, monkeypatch) -> None:
    """Two distributions of one package side by side (a CPU build pulled in by a dependency,
    a GPU build earlier on the path): the version reported is the one ``import`` loads."""
    from runtime_agent.fingerprint import package_version

    def install(root: Path, dist: str, version: str, with_package: bool) -> None:
        info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        if with_package:
            (root / "kilnfakeort").mkdir()
            (root / "kilnfakeort" / "__init__.py").write_text("")

    cpu, gpu = tmp_path / "site-cpu", tmp_path / "site-gpu"
    install(cpu, "kilnfakeort", "1.30.0", with_package=True)
    install(gpu, "kilnfakeort-gpu", "1.31.1", with_package=True)
    monkeypatch.setattr(sys, "path", [str(gpu), str(cpu), *sys.path])
    assert package_version("kilnfakeort", "kilnfakeort-gpu") == "1.30.0"  # by name alone
    assert package_version("kilnfakeort", "kilnfakeort-gpu", module="kilnfakeort") == "1.31.1"
    monkeypatch.setattr(sys, "path", [str(cpu), str(gpu), *sys.path[2:]])
    assert package_version("kilnfakeort", "kilnfakeort-gpu", module="kilnfakeort") == "1.30.0"
    assert package_version("kilnfakeort-gpu", module="kilnfakeort") == "1.31.1"  # only one
    assert package_version("absent-dist", module="kilnfakeort") is None

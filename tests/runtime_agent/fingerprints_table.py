"""Fingerprints of real machines, written from public specifications.

CPU feature lines are ``/proc/cpuinfo`` as those CPUs print them (x86 ``flags``, Arm
``Features``), cut to the words that matter plus a few that Kiln must ignore, and parsed with
Kiln's own ``parse_cpuinfo``. GPU figures are the vendors' datasheet numbers: compute
capability (NVIDIA's CUDA GPU list), SM count, memory (in GiB as a round figure; NVML reports a
little less). Software versions are a plausible, consistent fleet (onnxruntime 1.20.1,
TensorRT 10.3.0, CUDA 12.x drivers), not part of the hardware.

``TABLE`` maps a short name to an ``Entry``: the fingerprint and what the tests expect of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime_agent.fingerprint import parse_cpuinfo
from schemas.fingerprint import AcceleratorInfo, CpuInfo, HardwareFingerprint, RuntimeVersions

GiB = 1 << 30
ORT = "1.20.1"
TRT = "10.3.0"

# -- CPUs ----------------------------------------------------------------------------------

_X86_BASE = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush "
             "mmx fxsr sse sse2 ht syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl "
             "xtopology nonstop_tsc cpuid pni pclmulqdq ssse3 fma cx16 sse4_1 sse4_2 x2apic "
             "movbe popcnt aes xsave avx f16c rdrand hypervisor lahf_lm abm")
#: AMD EPYC 7742 / 7002 "Zen 2": AVX2, FMA, BMI1/2, SHA; no AVX-512.
ZEN2_FLAGS = _X86_BASE + (" cmp_legacy svm extapic cr8_legacy sse4a misalignsse 3dnowprefetch "
                          "osvw topoext perfctr_core bmi1 avx2 smep bmi2 rdseed adx smap "
                          "clflushopt clwb sha_ni xsaveopt xsavec xgetbv1 clzero wbnoinvd")
#: Intel Xeon (Cascade Lake, 2nd gen Xeon Scalable): AVX-512 F/CD/DQ/BW/VL and VNNI.
CASCADE_LAKE_FLAGS = _X86_BASE + (" 3dnowprefetch fsgsbase bmi1 hle avx2 smep bmi2 erms invpcid "
                                  "rtm mpx avx512f avx512dq rdseed adx smap clflushopt clwb "
                                  "avx512cd avx512bw avx512vl xsaveopt xsavec xgetbv1 "
                                  "avx512_vnni md_clear arch_capabilities")
#: Intel Xeon Platinum 8380 (Ice Lake-SP, 3rd gen): Cascade Lake's AVX-512 plus IFMA, VBMI,
#: VBMI2, BITALG, VPOPCNTDQ (which do not change Kiln's class); no BF16, no AMX.
ICE_LAKE_SP_FLAGS = _X86_BASE + (" 3dnowprefetch fsgsbase bmi1 avx2 smep bmi2 erms invpcid "
                                 "avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb "
                                 "avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 "
                                 "wbnoinvd avx512vbmi umip pku ospke avx512_vbmi2 gfni vaes "
                                 "vpclmulqdq avx512_vnni avx512_bitalg avx512_vpopcntdq "
                                 "rdpid md_clear arch_capabilities")
#: Intel Xeon Platinum 8480+/8480C (Sapphire Rapids, 4th gen): adds AVX-512 BF16 and FP16,
#: AVX-VNNI and AMX (TILE, BF16, INT8).
SAPPHIRE_RAPIDS_FLAGS = ICE_LAKE_SP_FLAGS + (" avx_vnni avx512_bf16 serialize tsxldtrk "
                                             "amx_bf16 avx512_fp16 amx_tile amx_int8")

#: AWS Graviton2: Arm Neoverse N1 (Armv8.2: dot product, fp16; no SVE).
NEOVERSE_N1_FEATURES = ("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid "
                        "asimdrdm lrcpc dcpop asimddp ssbs")
#: AWS Graviton3: Arm Neoverse V1 (SVE 256-bit, int8 matmul, bf16; no SVE2).
NEOVERSE_V1_FEATURES = ("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid "
                        "asimdrdm jscvt fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve "
                        "asimdfhm dit uscat ilrcpc flagm ssbs paca pacg dcpodp svei8mm svebf16 "
                        "i8mm bf16 dgh rng")
#: NVIDIA Grace: Arm Neoverse V2 (Armv9: SVE2, int8 matmul, bf16).
NEOVERSE_V2_FEATURES = ("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid "
                        "asimdrdm jscvt fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve "
                        "asimdfhm dit uscat ilrcpc flagm ssbs sb paca pacg dcpodp sve2 sveaes "
                        "svepmull svebitperm svesha3 svesm4 flagm2 frint svei8mm svebf16 i8mm "
                        "bf16 dgh bti")
#: Jetson AGX Orin: Arm Cortex-A78AE (Armv8.2 with dot product; no SVE, no i8mm/bf16).
CORTEX_A78AE_FEATURES = ("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp "
                         "cpuid asimdrdm lrcpc dcpop asimddp uscat ilrcpc flagm")


def _x86(vendor: str, model: str, flags: str, cores: int, memory_gib: int) -> CpuInfo:
    text = f"processor\t: 0\nvendor_id\t: {vendor}\nmodel name\t: {model}\nflags\t\t: {flags}\n"
    vendor_id, model_name, features = parse_cpuinfo(text, "x86_64")
    return CpuInfo(arch="x86_64", vendor=vendor_id, model=model_name, features=features,
                   cores=cores, memory_bytes=memory_gib * GiB)


def _arm(part: str, features_line: str, cores: int, memory_gib: int) -> CpuInfo:
    text = (f"processor\t: 0\nFeatures\t: {features_line}\nCPU implementer\t: 0x41\n"
            f"CPU architecture: 8\nCPU part\t: {part}\n")
    vendor, model, features = parse_cpuinfo(text, "aarch64")
    return CpuInfo(arch="aarch64", vendor=vendor, model=model, features=features, cores=cores,
                   memory_bytes=memory_gib * GiB)


def _gpu(name: str, cc: str, sm_count: int, memory_gib: int, driver: str) -> AcceleratorInfo:
    return AcceleratorInfo(kind="cuda", name=name, compute_capability=cc, sm_count=sm_count,
                           memory_bytes=memory_gib * GiB, driver=driver)


def _fp(os: str, cpu: CpuInfo, gpus: list[AcceleratorInfo] = (), *, cuda: str | None = None,
        tensorrt: str | None = None) -> HardwareFingerprint:
    return HardwareFingerprint(
        os=os, cpu=cpu, accelerators=list(gpus),
        runtimes=RuntimeVersions(onnxruntime=ORT, onnx="1.17.0", tensorrt=tensorrt, cuda=cuda),
        source="declared",
    )


@dataclass(frozen=True)
class Entry:
    """A table fingerprint and what Kiln should make of it."""

    fingerprint: HardwareFingerprint
    isa_class: str
    ort_key: str
    trt_key: str | None = None
    integrated_gpu: bool = False


_UBUNTU_X86 = "Linux-5.15.0-105-generic-x86_64-with-glibc2.35"
_AL2023_ARM = "Linux-6.1.102-111.182.amzn2023.aarch64-aarch64-with-glibc2.34"
_DRIVER = "550.54.15"

EPYC_7742 = _x86("AuthenticAMD", "AMD EPYC 7742 64-Core Processor", ZEN2_FLAGS, 128, 1024)
XEON_8380 = _x86("GenuineIntel", "Intel(R) Xeon(R) Platinum 8380 CPU @ 2.30GHz",
                 ICE_LAKE_SP_FLAGS, 80, 512)
XEON_8480C = _x86("GenuineIntel", "Intel(R) Xeon(R) Platinum 8480C", SAPPHIRE_RAPIDS_FLAGS,
                  112, 2048)
XEON_CASCADE_LAKE = _x86("GenuineIntel", "Intel(R) Xeon(R) CPU @ 2.20GHz", CASCADE_LAKE_FLAGS,
                         8, 32)

TABLE: dict[str, Entry] = {
    # CPU-only nodes
    "epyc-7742-zen2": Entry(
        _fp(_UBUNTU_X86, EPYC_7742), "x86-64-v3", "ort-cpu-x86-64-v3-ort1.20"),
    "xeon-8380-icelake": Entry(
        _fp(_UBUNTU_X86, XEON_8380), "x86-64-v4", "ort-cpu-x86-64-v4-ort1.20"),
    "xeon-8480-sapphire-rapids": Entry(
        _fp(_UBUNTU_X86, XEON_8480C), "x86-64-v4", "ort-cpu-x86-64-v4-ort1.20"),
    "graviton2-neoverse-n1": Entry(
        _fp(_AL2023_ARM, _arm("0xd0c", NEOVERSE_N1_FEATURES, 64, 256)),
        "armv8-dotprod", "ort-cpu-armv8-dotprod-ort1.20"),
    "graviton3-neoverse-v1": Entry(
        _fp(_AL2023_ARM, _arm("0xd40", NEOVERSE_V1_FEATURES, 64, 128)),
        "armv8-sve", "ort-cpu-armv8-sve-ort1.20"),
    # GPU nodes: DGX H100 (2x Xeon 8480C), DGX A100 (2x EPYC 7742), GCP g2 (L4, Cascade Lake),
    # GH200 (Grace), Jetson AGX Orin 64GB (JetPack 6.1: CUDA 12.6, TensorRT 10.3)
    "h100-sxm-80gb": Entry(
        _fp(_UBUNTU_X86, XEON_8480C, [_gpu("NVIDIA H100 80GB HBM3", "9.0", 132, 80, _DRIVER)],
            cuda="12.4", tensorrt=TRT),
        "x86-64-v4", "ort-cpu-x86-64-v4-ort1.20", "trt-sm90-nvidia-h100-80gb-hbm3-trt10.3"),
    "a100-sxm4-40gb": Entry(
        _fp(_UBUNTU_X86, EPYC_7742, [_gpu("NVIDIA A100-SXM4-40GB", "8.0", 108, 40, _DRIVER)],
            cuda="12.4", tensorrt=TRT),
        "x86-64-v3", "ort-cpu-x86-64-v3-ort1.20", "trt-sm80-nvidia-a100-sxm4-40gb-trt10.3"),
    "a100-sxm4-80gb": Entry(
        _fp(_UBUNTU_X86, EPYC_7742, [_gpu("NVIDIA A100-SXM4-80GB", "8.0", 108, 80, _DRIVER)],
            cuda="12.4", tensorrt=TRT),
        "x86-64-v3", "ort-cpu-x86-64-v3-ort1.20", "trt-sm80-nvidia-a100-sxm4-80gb-trt10.3"),
    "l4": Entry(
        _fp(_UBUNTU_X86, XEON_CASCADE_LAKE, [_gpu("NVIDIA L4", "8.9", 58, 24, _DRIVER)],
            cuda="12.4", tensorrt=TRT),
        "x86-64-v4", "ort-cpu-x86-64-v4-ort1.20", "trt-sm89-nvidia-l4-trt10.3"),
    "t4": Entry(
        _fp(_UBUNTU_X86, XEON_CASCADE_LAKE, [_gpu("Tesla T4", "7.5", 40, 16, _DRIVER)],
            cuda="12.4", tensorrt=TRT),
        "x86-64-v4", "ort-cpu-x86-64-v4-ort1.20", "trt-sm75-tesla-t4-trt10.3"),
    "gh200": Entry(
        _fp("Linux-6.8.0-1013-nvidia-64k-aarch64-with-glibc2.39",
            _arm("0xd4f", NEOVERSE_V2_FEATURES, 72, 480),
            [_gpu("NVIDIA GH200 480GB", "9.0", 132, 96, _DRIVER)], cuda="12.4", tensorrt=TRT),
        "armv8-sve", "ort-cpu-armv8-sve-ort1.20", "trt-sm90-nvidia-gh200-480gb-trt10.3"),
    "jetson-agx-orin-64gb": Entry(
        _fp("Linux-5.15.148-tegra-aarch64-with-glibc2.35",
            _arm("0xd42", CORTEX_A78AE_FEATURES, 12, 64),
            [_gpu("Orin", "8.7", 16, 64, "")], cuda="12.6", tensorrt=TRT),
        "armv8-dotprod", "ort-cpu-armv8-dotprod-ort1.20", "trt-sm87-orin-trt10.3",
        integrated_gpu=True),
}

GPU_NODES = {name: entry for name, entry in TABLE.items() if entry.trt_key is not None}


def fingerprint(name: str) -> HardwareFingerprint:
    """The table fingerprint ``name``."""
    return TABLE[name].fingerprint


def with_tensorrt(fp: HardwareFingerprint, version: str | None) -> HardwareFingerprint:
    """``fp`` with another TensorRT version."""
    return fp.model_copy(update={"runtimes": {**fp.runtimes, **{"tensorrt": version}}})


def with_onnxruntime(fp: HardwareFingerprint, version: str | None) -> HardwareFingerprint:
    """``fp`` with another onnxruntime version."""
    return fp.model_copy(
        update={"runtimes": {**fp.runtimes, **{"onnxruntime": version}}})

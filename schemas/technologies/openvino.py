"""OpenVINO's rules (its executor: ``runtime_agent.executors.openvino``).

Keys. ``ov-cpu-<ISA class>[-<features>]-ov<version>``, e.g.
``ov-cpu-x86-64-v4-amx-bf16-fp16-vnni-ov2026.4.1``: the x86-64 level (or the aarch64 class)
and each ISA extension that gives the CPU plugin other kernels (``kernel_features``: AMX,
AVX-512 BF16, AVX-512 FP16, AVX-512 VNNI, AVX-VNNI; on aarch64 bf16, i8mm, fp16, sve), and the
full OpenVINO version. There is no compatibility key: a compiled blob runs only where both
match exactly (OpenVINO's CPU plugin refuses a blob of any other version or ISA).
"""

from __future__ import annotations

from collections.abc import Mapping

from schemas.errors import BackendUnavailable
from schemas.fingerprint import CpuInfo, HardwareFingerprint, isa_class
from schemas.technologies.base import Technology, slug, version_tuple

SUPPORTED_ARCHES = ("x86_64", "aarch64")
#: CPU features (``/proc/cpuinfo`` spelling, as ``CpuInfo.features`` holds them) that select
#: other CPU-plugin kernels beyond the ISA class, and their short names in the key.
X86_KERNEL_FEATURES = {
    "amx_bf16": "amx",
    "avx512_bf16": "bf16",
    "avx512_fp16": "fp16",
    "avx512_vnni": "vnni",
    "avx_vnni": "avxvnni",
}
ARM_KERNEL_FEATURES = {"bf16": "bf16", "i8mm": "i8mm", "fp16": "fp16", "sve": "sve"}


def openvino_version(fingerprint: HardwareFingerprint) -> str | None:
    """The full OpenVINO version (``2026.4.1``) of a fingerprint; ``None`` without one."""
    parts = version_tuple(fingerprint.runtimes.get("openvino"))
    return ".".join(str(p) for p in parts[:3]) if len(parts) >= 2 else None


def kernel_features(cpu: CpuInfo) -> list[str]:
    """The ISA extensions beyond ``isa_class`` that give OpenVINO's CPU plugin other kernels,
    by their short names, sorted: ``["amx", "bf16", "fp16", "vnni"]`` on a Sapphire Rapids."""
    features = {f.lower() for f in cpu.features}
    table = X86_KERNEL_FEATURES if cpu.arch == "x86_64" else (
        ARM_KERNEL_FEATURES if cpu.arch == "aarch64" else {})
    found = {short for name, short in table.items() if name in features}
    if cpu.arch == "x86_64" and "amx" in found and not {"amx_tile", "amx_int8"} <= features:
        found.discard("amx")  # AMX kernels need the tile unit and both data types
    return sorted(found)


def kernel_class(cpu: CpuInfo) -> str:
    """``<ISA class>[-<features>]``: the CPU part of the key."""
    return "-".join([isa_class(cpu), *kernel_features(cpu)])


def has_bf16(cpu: CpuInfo) -> bool:
    """Whether the CPU computes bf16 natively (AMX-BF16 or AVX-512 BF16; bf16 on aarch64):
    where OpenVINO's bf16 inference precision is worth a candidate."""
    return bool({"amx", "bf16"} & set(kernel_features(cpu)))


class OpenVinoRules(Technology):
    """Keys ``ov-cpu-<ISA class>[-<features>]-ov<version>``, matched exactly."""

    backend = "openvino"
    runtime = "openvino"
    #: Below onnxruntime: an agent serves onnxruntime's key first when a deployment names no
    #: backend (the worker's tuner races OpenVINO's candidates within that job).
    preference = 8
    #: Its candidates race onnxruntime's in onnxruntime's job; a job of its own only when named.
    joins_as_peer = True
    plugin_frontends = True
    calibrates_with_nncf = True

    @classmethod
    def supports(cls, fingerprint: HardwareFingerprint) -> bool:
        return fingerprint.cpu.arch in SUPPORTED_ARCHES and openvino_version(
            fingerprint) is not None

    @classmethod
    def fingerprint_key(cls, fingerprint: HardwareFingerprint) -> str:
        """``ov-cpu-<ISA class>[-<features>]-ov<version>``."""
        version = openvino_version(fingerprint)
        if version is None or fingerprint.cpu.arch not in SUPPORTED_ARCHES:
            raise BackendUnavailable(
                f"the {cls.backend} backend supports {list(SUPPORTED_ARCHES)} CPUs with an "
                f"OpenVINO version; the fingerprint has arch {fingerprint.cpu.arch!r} and "
                f"runtimes.openvino={fingerprint.runtimes.get('openvino')!r}",
                backend=cls.backend)
        return slug(f"ov-cpu-{kernel_class(fingerprint.cpu)}-ov{version}")

    @classmethod
    def compatible(
        cls,
        built_on: HardwareFingerprint,
        node: HardwareFingerprint,
        runtime_config: Mapping[str, object] | None = None,
    ) -> bool:
        """Only the exact key: OpenVINO imports a blob only under the version and ISA that
        compiled it."""
        return (cls.supports(built_on) and cls.supports(node)
                and cls.fingerprint_key(built_on) == cls.fingerprint_key(node))

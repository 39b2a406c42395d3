"""TensorRT's rules (its executor: ``runtime_agent.executors.tensorrt``).

Keys and compatibility (TensorRT's "Hardware Compatibility" and "Version Compatibility"):

- exact key ``trt-sm<CC>-<GPU name>-trt<major.minor>``: a default plan runs only there;
- a plan built with ``hardware_compatibility_level`` ``ampere_plus`` runs on every discrete
  GPU of compute capability >= 8.0, ``same_compute_capability`` on every discrete GPU of the
  build GPU's compute capability. TensorRT supports hardware compatibility on Ampere and later
  only, from 8.6 on, and not on Jetson / DRIVE (integrated GPUs,
  ``INTEGRATED_COMPUTE_CAPABILITIES``); Kiln also gives version-compatible plans built or run
  on integrated GPUs no compatibility key (a conservative assumption: only the exact key);
- a ``version_compatible`` plan also runs under a later TensorRT of the same major version
  (built with >= 8.6). The support matrix says "within the same major version"; newer guides
  also allow some cross-major pairs (8 → 10, 10 → 11) with API caveats — Kiln stays with the
  support matrix;
- plans are not portable across platforms, so the compatibility keys carry the host CPU
  architecture (Kiln nodes run Linux).

As keys: an engine's compatibility key is ``trt-<hardware>-<arch>-trt<major.minor>[-vc]`` with
``<hardware>`` ``ampere-plus``, ``sm<CC>``, or — a version-compatible plan without hardware
compatibility — ``sm<CC>-<GPU name>``; a node lists every such key it runs, including the
``-vc`` keys of each earlier minor version of its TensorRT major. ``compatible()`` states the
same rules directly; tests check the two agree.
"""

from __future__ import annotations

from collections.abc import Mapping

from schemas.errors import BackendUnavailable
from schemas.fingerprint import AcceleratorInfo, HardwareFingerprint
from schemas.technologies.base import Technology, major_minor, slug, version_tuple

#: First compute capability of the Ampere generation.
AMPERE = (8, 0)
#: First TensorRT version with hardware and version compatibility.
COMPAT_MIN_TRT = (8, 6)
#: Compute capabilities that only integrated (Jetson / DRIVE) GPUs have, from NVIDIA's CUDA GPU
#: list: TX1/Nano 5.3, TX2 6.2, Xavier 7.2, Orin 8.7, Thor 10.1 (11.0 from CUDA 13 on).
INTEGRATED_COMPUTE_CAPABILITIES = frozenset({(5, 3), (6, 2), (7, 2), (8, 7), (10, 1), (11, 0)})


def cuda_device(fingerprint: HardwareFingerprint) -> AcceleratorInfo | None:
    """The first CUDA accelerator of a fingerprint (the one a build targets)."""
    return next((a for a in fingerprint.accelerators if a.kind == "cuda"), None)


def compute_capability(accelerator: AcceleratorInfo) -> tuple[int, int] | None:
    """``"8.6"`` → ``(8, 6)``; ``None`` when absent or malformed."""
    parts = version_tuple(accelerator.compute_capability)
    return (parts[0], parts[1]) if len(parts) >= 2 else None


def is_integrated(accelerator: AcceleratorInfo) -> bool:
    """Whether the GPU is a Jetson / DRIVE integrated GPU (by compute capability)."""
    return compute_capability(accelerator) in INTEGRATED_COMPUTE_CAPABILITIES


def _identity(fingerprint: HardwareFingerprint) -> tuple[tuple[int, int], str, bool]:
    """(compute capability, GPU name slug, integrated) of the fingerprint's CUDA device;
    ``((0, 0), "", False)`` without one."""
    device = cuda_device(fingerprint)
    if device is None:
        return (0, 0), "", False
    return compute_capability(device) or (0, 0), slug(device.name), is_integrated(device)


def _portable_toolchain(fingerprint: HardwareFingerprint) -> tuple[int, int] | None:
    """TensorRT (major, minor) when the fingerprint's GPU and TensorRT allow portable plans."""
    version = version_tuple(fingerprint.runtimes.get('tensorrt'))[:2]
    if len(version) < 2 or version < COMPAT_MIN_TRT or _identity(fingerprint)[2]:
        return None
    return version[0], version[1]


def _key(hardware: str, fingerprint: HardwareFingerprint, version: tuple[int, int],
         vc: bool) -> str:
    arch = fingerprint.cpu.arch
    return slug(f"trt-{hardware}-{arch}-trt{version[0]}.{version[1]}{'-vc' if vc else ''}")


class TensorRTRules(Technology):
    """Exact keys by GPU and TensorRT ``major.minor``; hardware- and version-compatible plans
    carry the coarser keys TensorRT's compatibility modes allow."""

    backend = "tensorrt"
    runtime = "tensorrt"
    preference = 100

    @classmethod
    def portable_key(cls, fingerprint: HardwareFingerprint) -> str | None:
        """The key of a hardware- and version-compatible plan built here (``portability:
        portable``); ``None`` where TensorRT builds none (integrated GPUs, before Ampere)."""
        return cls.compatibility_key(fingerprint, {"hardware_compatibility_level":
                                                   "ampere_plus", "version_compatible": True})

    @classmethod
    def supports(cls, fingerprint: HardwareFingerprint) -> bool:
        device = cuda_device(fingerprint)
        return (
            device is not None
            and compute_capability(device) is not None
            and major_minor(fingerprint.runtimes.get('tensorrt')) is not None
        )

    @classmethod
    def fingerprint_key(cls, fingerprint: HardwareFingerprint) -> str:
        """``trt-sm<CC>-<GPU name>-trt<major.minor>``, e.g.
        ``trt-sm90-nvidia-h100-80gb-hbm3-trt10.3``."""
        if not cls.supports(fingerprint):
            raise BackendUnavailable(
                f"the {cls.backend} backend needs a CUDA accelerator with a compute capability "
                f"and a TensorRT version; the fingerprint has accelerators "
                f"{[a.model_dump() for a in fingerprint.accelerators]} and tensorrt "
                f"{fingerprint.runtimes.get('tensorrt')!r}"
            )
        cc, name, _ = _identity(fingerprint)
        version = major_minor(fingerprint.runtimes.get('tensorrt'))
        return slug(f"trt-sm{cc[0]}{cc[1]}-{name}-trt{version}")

    @classmethod
    def compatibility_key(
        cls, built_on: HardwareFingerprint, runtime_config: Mapping[str, object] | None = None
    ) -> str | None:
        """``trt-ampere-plus-<arch>-trt<mm>`` / ``trt-sm<CC>-<arch>-trt<mm>`` for plans built
        with that hardware-compatibility level, ``trt-sm<CC>-<GPU>-<arch>-trt<mm>-vc`` for a
        version-compatible plan without one (``-vc`` also ends the others when set); ``None``
        for a default plan, an integrated GPU, TensorRT < 8.6 or an unknown level."""
        if not cls.supports(built_on):
            return None
        version = _portable_toolchain(built_on)
        if version is None:
            return None
        config = runtime_config or {}
        level = config.get("hardware_compatibility_level", "none")
        vc = config.get("version_compatible", False) is True
        cc, name, _ = _identity(built_on)
        if level == "ampere_plus":
            hardware = "ampere-plus" if cc >= AMPERE else None
        elif level == "same_compute_capability":
            hardware = f"sm{cc[0]}{cc[1]}" if cc >= AMPERE else None
        elif level == "none":
            hardware = f"sm{cc[0]}{cc[1]}-{name}" if vc else None
        else:
            hardware = None
        return None if hardware is None else _key(hardware, built_on, version, vc)

    @classmethod
    def compatibility_keys(cls, fingerprint: HardwareFingerprint) -> list[str]:
        """Every compatibility key whose plans run here: on a GPU of compute capability
        >= 8.0, this TensorRT ``major.minor``'s ``sm<CC>`` and ``ampere-plus`` keys; and the
        ``-vc`` keys of those and of ``sm<CC>-<GPU name>`` for each minor version up to this one
        within this major (from 8.6 for TensorRT 8). None on an integrated GPU."""
        if not cls.supports(fingerprint):
            return []
        version = _portable_toolchain(fingerprint)
        if version is None:
            return []
        cc, name, _ = _identity(fingerprint)
        hardware = [f"sm{cc[0]}{cc[1]}", "ampere-plus"] if cc >= AMPERE else []
        keys = [_key(h, fingerprint, version, False) for h in hardware]
        major, minor = version
        first_minor = COMPAT_MIN_TRT[1] if major == COMPAT_MIN_TRT[0] else 0
        for earlier in range(first_minor, minor + 1):
            keys += [_key(h, fingerprint, (major, earlier), True)
                     for h in [*hardware, f"sm{cc[0]}{cc[1]}-{name}"]]
        return keys

    @classmethod
    def compatible(
        cls,
        built_on: HardwareFingerprint,
        node: HardwareFingerprint,
        runtime_config: Mapping[str, object] | None = None,
    ) -> bool:
        """The exact key; or, for a plan built with hardware / version compatibility, what
        TensorRT documents (see the module docstring): discrete GPUs only, TensorRT >= 8.6 on
        both sides, the same host architecture; ``ampere_plus`` needs compute capability >= 8.0
        on both, ``same_compute_capability`` the same one (>= 8.0), and without a level the
        same GPU; the node's TensorRT must be the same ``major.minor`` — or, for a
        version-compatible plan, the same major and a minor at least the build's."""
        if not (cls.supports(built_on) and cls.supports(node)):
            return False
        if cls.fingerprint_key(built_on) == cls.fingerprint_key(node):
            return True
        built_version, node_version = _portable_toolchain(built_on), _portable_toolchain(node)
        if built_version is None or node_version is None or built_on.cpu.arch != node.cpu.arch:
            return False
        config = runtime_config or {}
        level = config.get("hardware_compatibility_level", "none")
        vc = config.get("version_compatible", False) is True
        built_cc, built_name, _ = _identity(built_on)
        node_cc, node_name, _ = _identity(node)
        if level == "ampere_plus":
            hardware_ok = built_cc >= AMPERE and node_cc >= AMPERE
        elif level == "same_compute_capability":
            hardware_ok = built_cc == node_cc and built_cc >= AMPERE
        elif level == "none":
            hardware_ok = vc and built_cc == node_cc and built_name == node_name
        else:
            hardware_ok = False
        version_ok = built_version == node_version or (
            vc and built_version[0] == node_version[0] and built_version[1] <= node_version[1])
        return hardware_ok and version_ok

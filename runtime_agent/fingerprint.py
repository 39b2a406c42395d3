"""Hardware fingerprinting: what this node is, and which toolchain it runs.

``detect_fingerprint()`` reads the machine: ``platform``, ``/proc/cpuinfo``, ``/proc/meminfo``,
NVIDIA GPUs through NVML (``pynvml`` from the ``nvidia-ml-py`` package, imported lazily; no
library or no driver means no accelerators), and toolchain versions from package metadata.
``load_fingerprint()`` reads a complete declared one from a JSON file. ``resolve_fingerprint()``
is what a service calls: the declared file if one is configured — merged onto the detected
fingerprint, so a file may declare only the fields it wants to change (a GPU on a CPU-only test
machine, another onnxruntime version) — else the detected one. ``isa_class()`` condenses the
CPU features to the class that decides which CPU kernels an engine may contain.

Only the ISA features that change kernel selection are kept, so two machines of the same class
produce the same feature list regardless of unrelated flags (``hypervisor``, ``rdrand``, ...).
Nothing here reads the environment: the services' settings name the declared file.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import platform
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from schemas.errors import InvalidRequest
from schemas.fingerprint import (
    X86_FEATURES,
    X86_LEVELS,
    AcceleratorInfo,
    CpuInfo,
    HardwareFingerprint,
    isa_class,
)  # the level rules live in schemas; re-exported here
from schemas.technologies.base import major_minor as major_minor  # the key text helpers too
from schemas.technologies.base import slug as slug
from schemas.technologies.base import version_tuple as version_tuple

logger = logging.getLogger(__name__)

_ARCH_ALIASES = {
    "x86_64": "x86_64",
    "amd64": "x86_64",
    "x64": "x86_64",
    "aarch64": "aarch64",
    "arm64": "aarch64",
    "armv8l": "aarch64",
    "armv8b": "aarch64",
}

#: Arm ``Features`` words that decide kernels, mapped to Kiln's names.
ARM_FEATURES = {
    "asimd": "neon",
    "neon": "neon",
    "asimdhp": "fp16",
    "asimddp": "dotprod",
    "sve": "sve",
    "sve2": "sve2",
    "i8mm": "i8mm",
    "bf16": "bf16",
}

#: ``CPU implementer`` codes from the Arm ARM (MIDR_EL1), for a readable vendor.
_ARM_IMPLEMENTERS = {
    "0x41": "ARM",
    "0x42": "Broadcom",
    "0x43": "Cavium",
    "0x46": "Fujitsu",
    "0x48": "HiSilicon",
    "0x4e": "NVIDIA",
    "0x51": "Qualcomm",
    "0x61": "Apple",
    "0xc0": "Ampere",
}
_ARM_PARTS = {  # (implementer, part) -> core name: common server and Jetson cores
    ("0x41", "0xd0c"): "Neoverse-N1",
    ("0x41", "0xd41"): "Cortex-A78",
    ("0x41", "0xd42"): "Cortex-A78AE",
    ("0x41", "0xd40"): "Neoverse-V1",
    ("0x41", "0xd49"): "Neoverse-N2",
    ("0x41", "0xd4f"): "Neoverse-V2",
    ("0x41", "0xd8e"): "Neoverse-N3",
    ("0x41", "0xd84"): "Neoverse-V3",
    ("0xc0", "0xac3"): "AmpereOne",
}


def normalize_arch(machine: str) -> str:
    """``platform.machine()`` spelled the Kiln way: ``x86_64``, ``aarch64``, else lower-case."""
    return _ARCH_ALIASES.get(machine.lower(), machine.lower())


def parse_cpuinfo(text: str, arch: str) -> tuple[str, str, list[str]]:
    """(vendor, model, kernel-deciding features) from ``/proc/cpuinfo`` text of ``arch``.

    Only the first processor block is read: Kiln assumes a node's cores share one ISA.
    """
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip().lower(), value.strip())
    if arch == "x86_64":
        flags = set(fields.get("flags", "").lower().split())
        features = sorted(flags & X86_FEATURES)
        return fields.get("vendor_id", ""), fields.get("model name", ""), features
    if arch == "aarch64":
        words = fields.get("features", "").lower().split()
        features = sorted({ARM_FEATURES[w] for w in words if w in ARM_FEATURES})
        implementer = fields.get("cpu implementer", "").lower()
        part = fields.get("cpu part", "").lower()
        vendor = _ARM_IMPLEMENTERS.get(implementer, implementer)
        model = fields.get("model name") or _ARM_PARTS.get((implementer, part), "")
        if not model and part:
            model = f"part {part}"
        return vendor, model, features
    return fields.get("vendor_id", ""), fields.get("model name", ""), []


def older_variant(fingerprint: HardwareFingerprint) -> HardwareFingerprint:
    """The same machine one x86-64 level down, as a node of an older chip variant would
    detect itself: the features of the level above its class removed, marked ``declared``.

    Used to stand a second chip variant up on one machine (``--fingerprint-file``), for
    tests, benchmarks and trying out routing. x86_64 only; ``ValueError`` when there is no
    level below (the machine is already baseline x86-64).
    """
    if fingerprint.cpu.arch != "x86_64":
        raise ValueError(f"older_variant needs an x86_64 fingerprint, not {fingerprint.cpu.arch}")
    current = isa_class(fingerprint.cpu)
    levels = dict(X86_LEVELS)
    names = list(levels)
    if current not in levels:
        raise ValueError("this machine is baseline x86-64: there is no older level to declare")
    i = names.index(current)
    below = levels[names[i + 1]] if i + 1 < len(names) else frozenset()
    drop = levels[current] - below
    if current == "x86-64-v4":  # every AVX-512 extension and AMX goes with the base set
        drop |= {f for f in fingerprint.cpu.features if f.startswith(("avx512", "amx"))}
    variant = fingerprint.model_copy(deep=True)
    variant.cpu.features = [f for f in fingerprint.cpu.features if f.lower() not in drop]
    variant.cpu.model = f"{fingerprint.cpu.model} (declared {isa_class(variant.cpu)})".strip()
    variant.source = "declared"
    return variant


def _memory_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, AttributeError):
        return 0


def detect_cpu() -> CpuInfo:
    """This machine's CPU. Vendor, model and features come from ``/proc/cpuinfo`` (Linux)."""
    arch = normalize_arch(platform.machine())
    vendor, model, features = "", "", []
    try:
        vendor, model, features = parse_cpuinfo(Path("/proc/cpuinfo").read_text(), arch)
    except OSError as exc:
        logger.info("no /proc/cpuinfo (%s); CPU features left empty", exc)
    return CpuInfo(
        arch=arch,
        vendor=vendor,
        model=model,
        features=features,
        cores=os.cpu_count() or 0,
        memory_bytes=_memory_bytes(),
    )


# -- NVIDIA GPUs (NVML) ---------------------------------------------------------------------

#: FP32 cores per streaming multiprocessor by compute capability (the CUDA C++ Programming
#: Guide's arithmetic-throughput table): turns NVML's core count into an SM count.
_CORES_PER_SM = {(7, 0): 64, (7, 5): 64, (8, 0): 64, (8, 6): 128, (8, 7): 128, (8, 9): 128,
                 (9, 0): 128}
#: Last-resort SM counts of common GPUs, by the name NVML reports (public specifications).
#: Used only when NVML gives neither the multiprocessor count nor the core count.
KNOWN_SM_COUNTS = {
    "NVIDIA H100 80GB HBM3": 132,
    "NVIDIA H100 PCIe": 114,
    "NVIDIA H200": 132,
    "NVIDIA A100-SXM4-40GB": 108,
    "NVIDIA A100-SXM4-80GB": 108,
    "NVIDIA A100-PCIE-40GB": 108,
    "NVIDIA A100 80GB PCIe": 108,
    "NVIDIA A10": 72,
    "NVIDIA L4": 58,
    "Tesla T4": 40,
}


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml_optional(nvml: Any, function: str, *args: object) -> Any:
    """``nvml.<function>(*args)``, or ``None`` when this pynvml, driver or GPU lacks it."""
    call = getattr(nvml, function, None)
    if call is None:
        return None
    try:
        return call(*args)
    except Exception as exc:  # NVMLError_NotSupported, _FunctionNotFound, _NoPermission, ...
        logger.debug("NVML %s failed: %s", function, exc)
        return None


def _sm_count(nvml: Any, handle: object, name: str, cc: tuple[int, int] | None) -> int:
    """Multiprocessors: NVML device attributes (MIG handles, newer drivers), else NVML's core
    count divided by the cores per SM of the compute capability, else ``KNOWN_SM_COUNTS``."""
    attributes = _nvml_optional(nvml, "nvmlDeviceGetAttributes", handle)
    if attributes is not None and getattr(attributes, "multiprocessorCount", 0):
        return int(attributes.multiprocessorCount)
    cores = _nvml_optional(nvml, "nvmlDeviceGetNumGpuCores", handle)
    if cores and cc in _CORES_PER_SM:
        return int(cores) // _CORES_PER_SM[cc]
    return KNOWN_SM_COUNTS.get(name, 0)


def cuda_version_string(encoded: int | None) -> str | None:
    """NVML's CUDA driver version (``1000 * major + 10 * minor``): ``12040`` → ``"12.4"``."""
    if not encoded:
        return None
    return f"{encoded // 1000}.{encoded % 1000 // 10}"


def nvml_accelerators(nvml: Any) -> tuple[list[AcceleratorInfo], str | None]:
    """(GPUs, CUDA driver version) read through an initialized ``pynvml`` module.

    Every GPU NVML lists, in NVML's order (PCI bus order, which may differ from CUDA's default
    device order): name, compute capability, total memory, SM count and driver version.
    """
    driver = _nvml_optional(nvml, "nvmlSystemGetDriverVersion")
    cuda = cuda_version_string(_nvml_optional(nvml, "nvmlSystemGetCudaDriverVersion"))
    found: list[AcceleratorInfo] = []
    for index in range(int(nvml.nvmlDeviceGetCount())):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        name = _text(nvml.nvmlDeviceGetName(handle))
        capability = _nvml_optional(nvml, "nvmlDeviceGetCudaComputeCapability", handle)
        cc = (int(capability[0]), int(capability[1])) if capability else None
        memory = _nvml_optional(nvml, "nvmlDeviceGetMemoryInfo", handle)
        found.append(AcceleratorInfo(
            kind="cuda",
            name=name,
            compute_capability=f"{cc[0]}.{cc[1]}" if cc else "",
            memory_bytes=int(memory.total) if memory is not None else 0,
            sm_count=_sm_count(nvml, handle, name, cc),
            driver=_text(driver) if driver is not None else "",
        ))
    return found, cuda


def detect_accelerators() -> tuple[list[AcceleratorInfo], str | None]:
    """(NVIDIA GPUs, CUDA driver version) through NVML.

    No ``pynvml`` (install the ``gpu`` extra), no NVML library or no driver: no accelerators,
    logged at debug level. A driver that fails mid-way is logged as a warning and also yields
    none, so a broken GPU never stops a node from registering its CPU.
    """
    try:
        import pynvml
    except ImportError:
        logger.debug("pynvml (package nvidia-ml-py) is not installed: no NVIDIA GPUs detected")
        return [], None
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        logger.debug("NVML is unavailable (%s): no NVIDIA GPUs detected", exc)
        return [], None
    try:
        return nvml_accelerators(pynvml)
    except Exception as exc:
        logger.warning("reading NVIDIA GPUs through NVML failed (%s); none reported", exc)
        return [], None
    finally:
        _nvml_optional(pynvml, "nvmlShutdown")


# -- toolchain versions ---------------------------------------------------------------------

def package_version(*distributions: str, module: str | None = None) -> str | None:
    """The version of the first of ``distributions`` installed here (package metadata; nothing
    is imported).

    With ``module``, the distribution that holds the package ``import module`` would load wins:
    where two are installed side by side (``onnxruntime`` pulled in by a dependency, and
    ``onnxruntime-gpu`` earlier on the path), the one that runs is the one that counts."""
    found: list[metadata.Distribution] = []
    for distribution in distributions:
        try:
            found.append(metadata.distribution(distribution))
        except metadata.PackageNotFoundError:
            continue
    if not found:
        return None
    if module is not None and len(found) > 1:
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
        for dist in found:
            if origin is not None and Path(str(dist.locate_file(
                    f"{module}/__init__.py"))).resolve() == origin:
                return dist.version
    return found[0].version


def detect_runtimes(cuda: str | None = None) -> dict[str, str | None]:
    """Installed toolchain versions: each registered executor probes its own runtime, plus the
    ``onnx`` package, ``cuda`` (the driver's CUDA version, from NVML) and ``kiln``."""
    from runtime_agent import executors  # the registry imports this module

    runtimes: dict[str, str | None] = {
        cls.runtime: cls.probe_version() for cls in executors.registered_classes()
    }
    runtimes.update(onnx=package_version("onnx"), cuda=cuda, kiln=package_version("kiln"))
    return runtimes


# -- the fingerprint: detected, declared, resolved ------------------------------------------

def detect_fingerprint() -> HardwareFingerprint:
    """Probe this machine: CPU, NVIDIA GPUs, OS and runtime versions."""
    accelerators, cuda = detect_accelerators()
    return HardwareFingerprint(
        os=platform.platform(),
        cpu=detect_cpu(),
        accelerators=accelerators,
        runtimes=detect_runtimes(cuda),
        source="detected",
    )


def _read_declaration(path: Path) -> Any:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise InvalidRequest(f"cannot read fingerprint file {path}: {exc}", path=str(path)) from exc
    try:
        return json.loads(text)
    except ValueError as exc:
        raise InvalidRequest(
            f"fingerprint file {path} is not a valid HardwareFingerprint JSON document: {exc}",
            path=str(path),
        ) from exc


def _invalid(origin: str, exc: ValidationError) -> InvalidRequest:
    return InvalidRequest(
        f"fingerprint file {origin} is not a valid HardwareFingerprint JSON document "
        f"(expected keys os, cpu{{arch, vendor, model, features, cores, memory_bytes}}, "
        f"accelerators[{{kind, name, compute_capability, memory_bytes, sm_count, driver}}], "
        f"runtimes{{<runtime name>: <version>}}): {exc}",
        path=origin,
    )


def load_fingerprint(path: Path) -> HardwareFingerprint:
    """A complete declared fingerprint from a JSON ``HardwareFingerprint`` file;
    ``source="declared"``. Raises ``InvalidRequest`` when the file cannot be read or does not
    validate on its own (``resolve_fingerprint`` accepts partial files)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise InvalidRequest(f"cannot read fingerprint file {path}: {exc}", path=str(path)) from exc
    try:
        fingerprint = HardwareFingerprint.model_validate_json(text)
    except ValidationError as exc:
        raise _invalid(str(path), exc) from exc
    return fingerprint.model_copy(update={"source": "declared"})


def _deep_merge(base: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def merge_fingerprint(
    base: HardwareFingerprint, declared: Mapping[str, Any], *, origin: str = "<declared>"
) -> HardwareFingerprint:
    """``base`` with a (partial) declaration laid over it; ``source="declared"``.

    Objects merge key by key (``{"runtimes": {"tensorrt": "10.3.0"}}`` changes one version);
    anything else replaces what ``base`` had — lists too, so ``accelerators`` and
    ``cpu.features`` are declared whole, and ``"accelerators": []`` declares none. A ``source``
    in the declaration is ignored. Raises ``InvalidRequest`` (naming ``origin``) when the
    declaration is not an object or the result does not validate.
    """
    if not isinstance(declared, Mapping):
        raise InvalidRequest(
            f"fingerprint file {origin} must hold a JSON object (a full or partial "
            f"HardwareFingerprint); it holds {type(declared).__name__}",
            path=origin,
        )
    merged = _deep_merge(base.model_dump(mode="json"), declared)
    merged["source"] = "declared"
    try:
        return HardwareFingerprint.model_validate(merged)
    except ValidationError as exc:
        raise _invalid(origin, exc) from exc


def resolve_fingerprint(file: Path | None = None) -> HardwareFingerprint:
    """This node's fingerprint: the declared ``file`` merged onto the detected fingerprint
    when one is given (see ``merge_fingerprint``), else the detected one.

    Services pass the file their settings name (``KILN_FINGERPRINT_FILE`` for a worker,
    ``KILN_AGENT_FINGERPRINT_FILE`` for an agent).
    """
    if file is None:
        return detect_fingerprint()
    declared = _read_declaration(Path(file))
    return merge_fingerprint(detect_fingerprint(), declared, origin=str(file))


#: The variants ``declare_variant`` stands up on one machine (``kiln fingerprint --variant``).
VARIANTS = ("no-vnni", "no-amx-bf16", "cores=N", "older", "aarch64")
_VNNI = {"avx512_vnni", "avx_vnni", "amx_int8"}
_AMX_BF16 = {"amx_tile", "amx_bf16", "amx_int8", "avx512_bf16"}


def declare_variant(fingerprint: HardwareFingerprint, variant: str) -> HardwareFingerprint:
    """``fingerprint`` as another chip variant would detect itself, marked ``declared``:
    ``no-vnni`` (no int8 dot-product instruction), ``no-amx-bf16`` (no AMX, no AVX-512 BF16),
    ``cores=N``, ``older`` (one x86-64 level down, ``older_variant``), ``aarch64`` (a
    Neoverse-N1: NEON, FP16, dot product). Engines built by a worker that declares one still
    run on this machine's real ISA: it stands up routing, requirements and retuning, not the
    variant's kernels. ``ValueError`` naming the known variants otherwise."""
    variant = variant.strip().lower()
    declared = fingerprint.model_copy(deep=True)
    declared.source = "declared"
    cpu = declared.cpu
    if variant == "older":
        return older_variant(fingerprint)
    if variant in ("no-vnni", "no-amx-bf16"):
        drop = _VNNI if variant == "no-vnni" else _AMX_BF16
        cpu.features = [f for f in cpu.features if f not in drop]
    elif variant.startswith("cores="):
        try:
            cpu.cores = int(variant.removeprefix("cores="))
        except ValueError:
            cpu.cores = -1
        if cpu.cores < 1:
            raise ValueError(f"variant {variant!r}: cores=N needs a positive integer N")
    elif variant == "aarch64":
        cpu.arch, cpu.vendor, cpu.model = "aarch64", "ARM", "Neoverse-N1"
        cpu.features = ["dotprod", "fp16", "neon"]
    else:
        raise ValueError(f"unknown variant {variant!r}; known variants are {list(VARIANTS)}")
    if variant != "aarch64":
        cpu.model = f"{fingerprint.cpu.model} (declared {variant})".strip()
    return declared

"""IREE's rules (its executor: ``runtime_agent.executors.iree``). They read only the
fingerprint, so the control plane and a worker that cross-compiles for another architecture
compute them too.

Keys. ``iree-cpu-<ISA class>[-<features>]-iree<major.minor>``, e.g.
``iree-cpu-x86-64-v3-iree3.13`` or ``iree-cpu-armv8-dotprod-i8mm-iree3.13``: the ISA class
(``schemas.fingerprint.isa_class``; it names the architecture, hence the target triple),
each extension beyond it that LLVM's code generator and IREE's micro-kernels use
(``target_features``), and the IREE ``major.minor`` (the VM bytecode and the HAL executable
format change between releases; compiler and runtime are released together). The engine is
compiled for exactly the key's CPU (``target_cpu`` and ``llvm_features``), never for ``host``:
what it requires is what its key says, whichever machine compiled it, which is what lets a
worker build engines for a node it is not (``--iree-llvmcpu-target-triple``).

Compatibility. A module compiled for an ISA class runs on every CPU of that architecture whose
class includes it (an ``x86-64-v3`` engine on an ``x86-64-v4`` node; an ``armv8`` engine on any
aarch64 node), when it was compiled for no feature beyond the class. As keys: such an engine
carries its own key as ``compatibility_key``, and a node lists the plain class keys of its class
and of every class below it (``compatibility_keys``). An engine with extra features (VNNI, i8mm)
runs only under its exact key.
"""

from __future__ import annotations

from collections.abc import Mapping

from schemas.errors import BackendUnavailable
from schemas.fingerprint import X86_LEVELS, CpuInfo, HardwareFingerprint, isa_class
from schemas.technologies.base import Technology, major_minor, slug

#: Architectures IREE's ``llvm-cpu`` target builds for here, and their target triples.
TRIPLES = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu"}
#: CPU features (``CpuInfo.features`` spelling) beyond the ISA class that give IREE other
#: code (LLVM instruction selection, micro-kernel variants), their short names in the key,
#: and LLVM's name for them.
X86_TARGET_FEATURES = {
    "avx512_vnni": ("vnni", "+avx512vnni"),
    "avx512_bf16": ("bf16", "+avx512bf16"),
    "avx512_fp16": ("fp16", "+avx512fp16"),
    "avx_vnni": ("avxvnni", "+avxvnni"),
}
ARM_TARGET_FEATURES = {
    "fp16": ("fp16", "+fullfp16"),
    "i8mm": ("i8mm", "+i8mm"),
    "bf16": ("bf16", "+bf16"),
}
#: LLVM's CPU for each ISA class (x86: the psABI levels LLVM knows as CPUs; aarch64: generic,
#: the class's features given as features).
_LLVM_CPU = {"x86-64-v4": "x86-64-v4", "x86-64-v3": "x86-64-v3", "x86-64-v2": "x86-64-v2",
             "x86-64": "x86-64", "armv8": "generic", "armv8-dotprod": "generic",
             "armv8-sve": "generic"}
_ARM_CLASS_FEATURES = {"armv8": ["+neon"], "armv8-dotprod": ["+neon", "+dotprod"],
                       "armv8-sve": ["+neon", "+sve"]}
#: The ISA classes of each architecture, most capable first: a class runs the plain engines
#: of every class after it (``armv8-sve`` does not imply dot-product, so aarch64 nodes run
#: their own class and baseline ``armv8``).
_X86_CLASSES = [name for name, _ in X86_LEVELS] + ["x86-64"]


def iree_version(fingerprint: HardwareFingerprint) -> str | None:
    """The IREE ``major.minor`` of a fingerprint (``3.13``); ``None`` without one."""
    return major_minor(fingerprint.runtimes.get("iree"))


def target_features(cpu: CpuInfo) -> list[str]:
    """The extensions beyond the ISA class an engine for ``cpu`` is compiled with, by their
    short names, sorted (``["bf16", "vnni"]`` on a Cooper Lake)."""
    features = {f.lower() for f in cpu.features}
    table = X86_TARGET_FEATURES if cpu.arch == "x86_64" else (
        ARM_TARGET_FEATURES if cpu.arch == "aarch64" else {})
    return sorted(short for name, (short, _) in table.items() if name in features)


def cpu_class(cpu: CpuInfo) -> str:
    """``<ISA class>[-<features>]``: the CPU part of the key."""
    return "-".join([isa_class(cpu), *target_features(cpu)])


def llvm_target(cls: str, features: list[str], arch: str) -> tuple[str, str, str]:
    """(triple, LLVM CPU, LLVM feature string) for an engine of ISA class ``cls`` with the
    extra ``features`` (short names) on ``arch``."""
    if arch not in TRIPLES or cls not in _LLVM_CPU:
        raise BackendUnavailable(
            f"the iree backend compiles for {sorted(_LLVM_CPU)} on {sorted(TRIPLES)}; asked "
            f"for ISA class {cls!r} on {arch!r}", backend="iree")
    table = X86_TARGET_FEATURES if arch == "x86_64" else ARM_TARGET_FEATURES
    by_short = dict(table.values())
    llvm = list(_ARM_CLASS_FEATURES.get(cls, [])) + [by_short[f] for f in features]
    return TRIPLES[arch], _LLVM_CPU[cls], ",".join(llvm)


def key_for(cls: str, features: list[str], version: str) -> str:
    return slug("-".join(["iree-cpu", cls, *features, f"iree{version}"]))


def classes_run_by(cpu: CpuInfo) -> list[str]:
    """The ISA classes whose plain engines ``cpu`` runs, its own first."""
    own = isa_class(cpu)
    if cpu.arch == "x86_64" and own in _X86_CLASSES:
        return _X86_CLASSES[_X86_CLASSES.index(own):]
    if cpu.arch == "aarch64":
        return [own] if own == "armv8" else [own, "armv8"]
    return [own]


def baseline_class(arch: str) -> str | None:
    """The ISA class every supported node of ``arch`` runs (portable engines)."""
    return {"x86_64": "x86-64-v2", "aarch64": "armv8"}.get(arch)


class IreeRules(Technology):
    """Keys by ISA class, extra features and IREE ``major.minor``; a module compiled for its
    class alone runs on every node whose class includes it."""

    backend = "iree"
    runtime = "iree"
    #: Below onnxruntime and OpenVINO: on a node that has those, their engines are served
    #: first; on a node with only IREE's runtime (an edge or arm64 node), IREE's key is the
    #: node's key.
    preference = 4
    #: Its LLVM builds take minutes and lose to onnxruntime's engines on x86 (`bench/engines.py`
    #: times them side by side): planned beside another backend only when named.
    planned_unnamed = False

    @classmethod
    def supports(cls, fingerprint: HardwareFingerprint) -> bool:
        return (fingerprint.cpu.arch in TRIPLES and iree_version(fingerprint) is not None
                and isa_class(fingerprint.cpu) in _LLVM_CPU)

    @classmethod
    def fingerprint_key(cls, fingerprint: HardwareFingerprint) -> str:
        """``iree-cpu-<ISA class>[-<features>]-iree<major.minor>``."""
        if not cls.supports(fingerprint):
            raise BackendUnavailable(
                f"the {cls.backend} backend supports {sorted(TRIPLES)} CPUs of ISA classes "
                f"{sorted(_LLVM_CPU)} with an IREE version; the fingerprint has arch "
                f"{fingerprint.cpu.arch!r}, class {isa_class(fingerprint.cpu)!r} and "
                f"runtimes.iree={fingerprint.runtimes.get('iree')!r}", backend=cls.backend)
        return key_for(isa_class(fingerprint.cpu), target_features(fingerprint.cpu),
                       str(iree_version(fingerprint)))

    @classmethod
    def compatibility_key(cls, built_on: HardwareFingerprint,
                          runtime_config: Mapping[str, object] | None = None) -> str | None:
        """The engine's own key when it was compiled for its ISA class alone (no extra
        features): then every node whose class includes it runs it."""
        config = runtime_config or {}
        if not cls.supports(built_on):
            return None
        features = config.get("cpu_features", target_features(built_on.cpu))
        if features:
            return None
        return key_for(str(config.get("cpu_class") or isa_class(built_on.cpu)), [],
                       str(iree_version(built_on)))

    @classmethod
    def compatibility_keys(cls, fingerprint: HardwareFingerprint) -> list[str]:
        """The plain keys of every ISA class this node's class includes (its own plain key
        too, when the node has extra features and so another exact key)."""
        if not cls.supports(fingerprint):
            return []
        version = str(iree_version(fingerprint))
        own = cls.fingerprint_key(fingerprint)
        return [k for k in (key_for(c, [], version) for c in classes_run_by(fingerprint.cpu))
                if k != own]

    @classmethod
    def portable_key(cls, fingerprint: HardwareFingerprint) -> str | None:
        base = baseline_class(fingerprint.cpu.arch)
        version = iree_version(fingerprint)
        return key_for(base, [], version) if base and version else None

    @classmethod
    def compatible(cls, built_on: HardwareFingerprint, node: HardwareFingerprint,
                   runtime_config: Mapping[str, object] | None = None) -> bool:
        if not (cls.supports(built_on) and cls.supports(node)):
            return False
        if cls.fingerprint_key(built_on) == cls.fingerprint_key(node):
            return True
        key = cls.compatibility_key(built_on, runtime_config)
        return key is not None and key in cls.compatibility_keys(node)

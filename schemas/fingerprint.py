"""The hardware fingerprint: what a node is, and which toolchain it runs."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field


class CpuInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    arch: str = Field(description="Machine architecture, normalized: x86_64 or aarch64")
    vendor: str = ""
    model: str = ""
    #: ISA feature flags, lower-case (avx2, avx512f, avx512_vnni, amx_tile, neon, sve, ...).
    features: list[str] = Field(default_factory=list)
    cores: int = 0
    memory_bytes: int = 0


class AcceleratorInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: str = "cuda"
    name: str
    compute_capability: str = ""
    memory_bytes: int = 0
    sm_count: int = 0
    driver: str = ""


#: Installed toolchain versions by name: every backend's runtime (each executor names its own and
#: probes its version), plus ``onnx``, ``cuda`` (the driver's CUDA version) and ``kiln``. A
#: declared fingerprint overrides one entry with ``{"runtimes": {"<name>": "<version>"}}``.
RuntimeVersions = dict[Annotated[str, Field(pattern=r"^[a-z][a-z0-9_.-]{0,63}$")], str | None]


class HardwareFingerprint(BaseModel):
    """The full description stored with every artifact ("which hardware built this?")."""

    model_config = ConfigDict(extra="forbid")

    os: str = ""
    cpu: CpuInfo
    accelerators: list[AcceleratorInfo] = Field(default_factory=list)
    runtimes: RuntimeVersions = Field(default_factory=dict)
    #: Set when the fingerprint was declared or simulated instead of detected.
    source: str = "detected"


# -- ISA levels, requirements and tuning context (pure rules every side shares) ---------------

#: x86 flags (``/proc/cpuinfo`` spelling) that decide kernels.
X86_FEATURES = frozenset({
    "ssse3", "sse4_1", "sse4_2", "popcnt",
    "avx", "avx2", "fma", "f16c", "bmi1", "bmi2",
    "avx512f", "avx512cd", "avx512dq", "avx512bw", "avx512vl",
    "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni",
    "amx_tile", "amx_bf16", "amx_int8",
})
#: Kiln's names of the Arm features that decide kernels.
ARM_FEATURE_NAMES = frozenset({"neon", "fp16", "dotprod", "sve", "sve2", "i8mm", "bf16"})
_X86_V2 = frozenset({"ssse3", "sse4_1", "sse4_2", "popcnt"})
_X86_V3 = _X86_V2 | {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2"}
_X86_V4 = _X86_V3 | {"avx512f", "avx512cd", "avx512dq", "avx512bw", "avx512vl"}
#: The x86-64 psABI levels, highest first, with the features each requires.
X86_LEVELS: tuple[tuple[str, frozenset[str]], ...] = (
    ("x86-64-v4", _X86_V4), ("x86-64-v3", _X86_V3), ("x86-64-v2", _X86_V2),
)
#: Features that exist only on top of another: declaring one without its base is a
#: fingerprint no CPU prints (AVX-512 extensions need AVX-512 F, AMX data types need the tile
#: unit, AVX-VNNI is an AVX2 extension).
_X86_NEEDS = {
    **{f: "avx512f" for f in ("avx512cd", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni",
                              "avx512_bf16", "avx512_fp16")},
    "amx_bf16": "amx_tile", "amx_int8": "amx_tile", "avx_vnni": "avx2",
}
#: Features that give int8 products without saturation (u8 x s8 accumulated in 32 bits): with
#: one of them an int8 engine may skip ``reduce_range``. onnxruntime#5849: a DistilBERT
#: quantized without it was right on a Xeon Gold 5218 (VNNI), wrong on a Gold 5118 (none).
INT8_DOT_FEATURES = ("avx512_vnni", "avx_vnni", "amx_int8", "dotprod", "i8mm")
#: Features that compute bf16 natively (AMX-BF16, AVX-512 BF16; Arm's BF16).
BF16_FEATURES = ("amx_bf16", "avx512_bf16", "bf16")
#: Core-count classes, by their upper bound: a thread policy tuned inside one class holds
#: within it, not across (a setting tuned on a 2-core worker is not a 64-core node's).
CORE_CLASSES: tuple[tuple[int, str], ...] = (
    (4, "c1-4"), (16, "c5-16"), (64, "c17-64"), (1 << 30, "c65+"))


def isa_class(cpu: CpuInfo) -> str:
    """The ISA class that decides which CPU kernels an engine may contain.

    x86_64 follows the x86-64 psABI micro-architecture levels, each level requiring the
    features of the one below: ``x86-64-v4`` (AVX-512 F/CD/DQ/BW/VL), ``x86-64-v3`` (AVX, AVX2,
    FMA, F16C, BMI1, BMI2), ``x86-64-v2`` (SSSE3, SSE4.1, SSE4.2, POPCNT), else ``x86-64``.
    aarch64: ``armv8-sve``, ``armv8-dotprod``, else ``armv8``. Any other arch is its own class.
    """
    features = {f.lower() for f in cpu.features}
    if cpu.arch == "x86_64":
        for name, required in X86_LEVELS:
            if required <= features:
                return name
        return "x86-64"
    if cpu.arch == "aarch64":
        if "sve" in features:
            return "armv8-sve"
        if "dotprod" in features:
            return "armv8-dotprod"
        return "armv8"
    return cpu.arch


def _level_rank(level: str) -> int:
    """x86-64 levels in order (``x86-64`` = 0 … ``x86-64-v4`` = 3); -1 for other classes."""
    names = ["x86-64"] + [name for name, _ in reversed(X86_LEVELS)]
    return names.index(level) if level in names else -1


def core_class(cores: int) -> str:
    """The core-count class of ``cores`` (``c1-4``, ``c5-16``, ``c17-64``, ``c65+``)."""
    for bound, name in CORE_CLASSES:
        if cores <= bound:
            return name
    return CORE_CLASSES[-1][1]


def _mm(version: str | None) -> str:
    """The leading numeric components of ``version`` as text (``"1.32.0"`` → ``"1.32.0"``)."""
    match = re.match(r"^\d+(\.\d+)*", version or "")
    return match.group() if match else ""


def fingerprint_inconsistencies(fingerprint: HardwareFingerprint) -> list[str]:
    """What no real CPU declares: features of another architecture (AMX on aarch64, NEON on
    x86_64), an extension without its base, an x86-64 level's features without those of the
    levels below. Empty for every detected fingerprint."""
    cpu = fingerprint.cpu
    features = {f.lower() for f in cpu.features}
    problems: list[str] = []
    if cpu.arch == "aarch64":
        foreign = sorted(features & (X86_FEATURES - ARM_FEATURE_NAMES))
        if foreign:
            problems.append(f"x86 feature(s) {foreign} on an aarch64 CPU")
    elif cpu.arch == "x86_64":
        foreign = sorted(features & (ARM_FEATURE_NAMES - X86_FEATURES))
        if foreign:
            problems.append(f"Arm feature(s) {foreign} on an x86_64 CPU")
        for feature, base in sorted(_X86_NEEDS.items()):
            if feature in features and base not in features:
                problems.append(f"{feature} without {base}")
        below: frozenset[str] = frozenset()
        for name, required in reversed(X86_LEVELS):
            own = required - below
            if own & features and not below <= features:
                problems.append(f"{name} feature(s) {sorted(own & features)} without the "
                                f"baseline of the levels below: missing {sorted(below - features)}")
            below = required
    if cpu.cores < 0:
        problems.append(f"cores {cpu.cores} < 0")
    return problems


class EngineRequirements(BaseModel):
    """What an engine needs to run *correctly*, derived by its backend from the winning
    candidate (not from the whole build host) and signed in its manifest."""

    model_config = ConfigDict(extra="forbid")

    arch: str
    #: The lowest ISA class whose kernels the engine holds (an x86-64 level or an aarch64
    #: class); ``None``: any CPU of ``arch``.
    isa_level: str | None = None
    #: Each feature its kernels or quantization rely on; ``"a|b"`` means either will do.
    features: list[str] = Field(default_factory=list)
    #: Runtime name → the version prefix it needs (``{"onnxruntime": "1.32"}``).
    runtimes: dict[str, str] = Field(default_factory=dict)
    #: The GPU compute capability the engine was built for, if it runs on a GPU.
    compute_capability: str | None = None
    #: A fingerprint key the node must have for the backend, where the backend knows no finer
    #: rule (an imported OpenVINO blob, a TensorRT plan): exactly its build host's.
    key: str | None = None
    #: Why each requirement holds, in words (shown with a refusal).
    reasons: list[str] = Field(default_factory=list)


class TuningContext(BaseModel):
    """What the winner was chosen for: where a node differs in ``depends_on`` (or in core
    class, when ``threads_tuned``), its own tuning could pick another winner."""

    model_config = ConfigDict(extra="forbid")

    cpu_model: str = ""
    cores: int = 0
    core_class: str = ""
    #: The features the backend's candidates depend on (each backend declares them) ...
    depends_on: list[str] = Field(default_factory=list)
    #: ... and which of them the build host has.
    features: list[str] = Field(default_factory=list)
    #: Whether thread-policy candidates raced (the core class then decided the winner).
    threads_tuned: bool = False


def _has(features: set[str], want: str) -> bool:
    return any(alt in features for alt in want.split("|"))


def unmet_requirements(requirements: EngineRequirements, fingerprint: HardwareFingerprint,
                       node_key: str | None = None) -> list[str]:
    """Each requirement ``fingerprint`` does not meet, in words; empty when it runs there.
    ``node_key``: the node's fingerprint key for the engine's backend (for ``key``)."""
    cpu = fingerprint.cpu
    features = {f.lower() for f in cpu.features}
    unmet: list[str] = []
    if cpu.arch != requirements.arch:
        unmet.append(f"architecture {requirements.arch} (the node is {cpu.arch})")
    level = requirements.isa_level
    if level and cpu.arch == requirements.arch:
        have = isa_class(cpu)
        if _level_rank(level) >= 0:
            if _level_rank(have) < _level_rank(level):
                unmet.append(f"ISA level {level} (the node is {have})")
        elif level != have and not (level == "armv8-dotprod" and have == "armv8-sve"
                                    and "dotprod" in features) and level != "armv8":
            unmet.append(f"ISA class {level} (the node is {have})")
    missing = [want for want in requirements.features if not _has(features, want)]
    if missing:
        unmet.append(f"CPU feature(s) {' and '.join(w.replace('|', ' or ') for w in missing)}")
    for runtime, version in sorted(requirements.runtimes.items()):
        # Numeric parts on both sides: a build recorded "2.13.0+cpu" where the node reports
        # the same release, and a local-version suffix is no other runtime.
        have_version, want = _mm(fingerprint.runtimes.get(runtime)), _mm(version) or version
        if not have_version or not (have_version == want
                                    or have_version.startswith(want + ".")):
            unmet.append(f"{runtime} {version} (the node has "
                         f"{fingerprint.runtimes.get(runtime) or 'none'})")
    if requirements.compute_capability is not None:
        ccs = [a.compute_capability for a in fingerprint.accelerators]
        if requirements.compute_capability not in ccs:
            unmet.append(f"a GPU of compute capability {requirements.compute_capability} "
                         f"(the node has {ccs or 'none'})")
    if requirements.key is not None and node_key != requirements.key:
        unmet.append(f"fingerprint key {requirements.key} (the node's is {node_key})")
    return unmet


def context_differences(context: TuningContext, fingerprint: HardwareFingerprint) -> list[str]:
    """Where ``fingerprint`` differs from ``context`` in what decided the winner: a feature
    the candidates depend on, or the core class when threads were tuned. Differences in
    anything else (the CPU's model name, a feature no candidate reads) never change a winner
    and are not listed."""
    features = {f.lower() for f in fingerprint.cpu.features}
    built = set(context.features)
    diffs = [f"{'no ' if f in built else ''}{f}" for f in sorted(context.depends_on)
             if (f in built) != (f in features)]
    node_class = core_class(fingerprint.cpu.cores)
    if context.threads_tuned and context.core_class and node_class != context.core_class:
        diffs.append(f"cores {fingerprint.cpu.cores} ({node_class}; tuned for "
                     f"{context.core_class})")
    return diffs


#: Between a fingerprint key and the tuning context that follows it in a context key.
CONTEXT_KEY_INFIX = "-t-"
#: The longest fingerprint key the API accepts (``schemas.agents.FINGERPRINT_KEY_PATTERN``).
_MAX_KEY_LENGTH = 200


def tuning_context_key(fingerprint_key: str, fingerprint: HardwareFingerprint,
                       tuning_features: Iterable[str]) -> str:
    """The key of ``fingerprint``'s own tuning for a backend whose key there is
    ``fingerprint_key`` and whose candidates read ``tuning_features``:
    ``<key>-t-<core class>-<each of those features this CPU has, sorted>``
    (``ort-cpu-x86-64-v4-ort1.32-t-c17-64-amxint8-avx512vnni-avxvnni``).

    A function of the fingerprint alone, not of the engine it is compared with: every node
    and every worker of the same kind derive the same key, so a worker consumes the queue of
    its own and the planner queues a node's tuning under it. A key that would pass the API's
    length names its features by a digest."""
    have = {f.lower() for f in fingerprint.cpu.features}
    features = [f.replace("_", "") for f in sorted(set(tuning_features)) if f in have]
    context = "-".join([core_class(fingerprint.cpu.cores).replace("+", "plus"), *features])
    key = f"{fingerprint_key}{CONTEXT_KEY_INFIX}{context}"
    if len(key) > _MAX_KEY_LENGTH:
        digest = hashlib.sha256(context.encode()).hexdigest()[:16]
        key = f"{fingerprint_key}{CONTEXT_KEY_INFIX}{digest}"[:_MAX_KEY_LENGTH]
    return key


def is_context_key_of(key: str, fingerprint_key: str) -> bool:
    """Whether ``key`` names a tuning context (``tuning_context_key``) of ``fingerprint_key``."""
    return key.startswith(fingerprint_key + CONTEXT_KEY_INFIX) and len(key) > len(
        fingerprint_key) + len(CONTEXT_KEY_INFIX)

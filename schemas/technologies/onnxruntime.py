"""ONNX Runtime's rules (its executor: ``runtime_agent.executors.onnxruntime``).

Compatibility. Basic and extended optimizations (levels 1–2) rewrite the graph with standard
ONNX ops and onnxruntime's contrib ops: the saved model runs on any CPU of the same architecture
under the same onnxruntime ``major.minor``. Level 3 adds layout optimizations whose blocking
follows the vector width, so such an engine needs the exact fingerprint key (ISA class and
onnxruntime ``major.minor``). As keys: every supported node has the compatibility key
``ort-cpu-<arch>-portable-ort<major.minor>``; an engine of levels 0–2 carries its build host's
portable key, a level-3 (or unknown-level) engine none.
"""

from __future__ import annotations

from collections.abc import Mapping

from schemas.errors import BackendUnavailable
from schemas.fingerprint import (
    INT8_DOT_FEATURES,
    EngineRequirements,
    HardwareFingerprint,
    TuningContext,
    isa_class,
)
from schemas.technologies.base import Technology, major_minor, slug

#: Build levels whose saved model is hardware-specific (layout optimizations).
HARDWARE_SPECIFIC_LEVEL = 3
SUPPORTED_ARCHES = ("x86_64", "aarch64")


def _portable(runtime_config: Mapping[str, object] | None) -> bool:
    """Whether the engine's build level (``optimization_level``) leaves it portable."""
    level = (runtime_config or {}).get("optimization_level", HARDWARE_SPECIFIC_LEVEL)
    return isinstance(level, int) and not isinstance(level, bool) and (
        0 <= level < HARDWARE_SPECIFIC_LEVEL)


class OnnxRuntimeRules(Technology):
    """Keys ``ort-cpu-<ISA class>-ort<major.minor>``; portable engines (levels 0–2) carry
    ``ort-cpu-<arch>-portable-ort<major.minor>``."""

    backend = "onnxruntime"
    runtime = "onnxruntime"
    preference = 10
    default_plugin_target = True
    #: int8 candidates read the int8 dot-product features (``reduce_range`` off with one),
    #: bf16 candidates Arm's bf16.
    tuning_features = (*INT8_DOT_FEATURES, "bf16")

    @classmethod
    def device_for(cls, runtime_config: Mapping[str, object]) -> str:
        """``cuda`` when the CUDA execution provider comes first, else ``cpu``."""
        providers = runtime_config.get("providers") or ["CPUExecutionProvider"]
        first = next(iter(providers), None) if isinstance(providers, list | tuple) else None
        return "cuda" if first == "CUDAExecutionProvider" else "cpu"

    @classmethod
    def supports(cls, fingerprint: HardwareFingerprint) -> bool:
        return (
            fingerprint.cpu.arch in SUPPORTED_ARCHES
            and major_minor(fingerprint.runtimes.get(cls.runtime)) is not None
        )

    @classmethod
    def fingerprint_key(cls, fingerprint: HardwareFingerprint) -> str:
        """``ort-cpu-<ISA class>-ort<major.minor>``, e.g. ``ort-cpu-x86-64-v4-ort1.32``."""
        version = major_minor(fingerprint.runtimes.get(cls.runtime))
        if version is None:
            raise BackendUnavailable(
                f"the fingerprint names no onnxruntime version "
                f"(runtimes.onnxruntime={fingerprint.runtimes.get(cls.runtime)!r}); "
                f"the {cls.backend} backend needs one"
            )
        return slug(f"ort-cpu-{isa_class(fingerprint.cpu)}-ort{version}")

    @classmethod
    def portable_key(cls, fingerprint: HardwareFingerprint) -> str | None:
        """``ort-cpu-<arch>-portable-ort<major.minor>``, e.g.
        ``ort-cpu-x86-64-portable-ort1.32``: the key of engines that need only the
        architecture and the onnxruntime version (levels 0–2)."""
        version = major_minor(fingerprint.runtimes.get(cls.runtime))
        if version is None or not cls.supports(fingerprint):
            raise BackendUnavailable(
                f"the {cls.backend} backend supports {list(SUPPORTED_ARCHES)} with an onnxruntime "
                f"version; the fingerprint has arch {fingerprint.cpu.arch!r} and onnxruntime "
                f"{fingerprint.runtimes.get(cls.runtime)!r}"
            )
        return slug(f"ort-cpu-{fingerprint.cpu.arch}-portable-ort{version}")

    @classmethod
    def compatibility_key(
        cls, built_on: HardwareFingerprint, runtime_config: Mapping[str, object] | None = None
    ) -> str | None:
        """The build host's portable key for levels 0–2; ``None`` for level 3 or an unknown
        level (a hardware-specific engine)."""
        if not cls.supports(built_on) or not _portable(runtime_config):
            return None
        return cls.portable_key(built_on)

    @classmethod
    def compatibility_keys(cls, fingerprint: HardwareFingerprint) -> list[str]:
        """The portable key, for every supported node."""
        return [cls.portable_key(fingerprint)] if cls.supports(fingerprint) else []

    @classmethod
    def requirements(cls, built_on: HardwareFingerprint, config: Mapping[str, object],
                     precision: str) -> EngineRequirements:
        """The architecture; the build host's ISA class for a level-3 engine (layouts blocked
        for its vector width), none for levels 0-2; an int8 dot-product feature for an int8
        engine quantized without ``reduce_range`` (without one, u8 x s8 products saturate and
        the outputs are wrong with no error: onnxruntime#5849, pytorch#103646); bf16 for
        MLAS's bf16 fast math; the onnxruntime ``major.minor``."""
        features: list[str] = []
        reasons: list[str] = []
        if not _portable(config):
            reasons.append(f"level-3 layouts blocked for {isa_class(built_on.cpu)}")
        dot = [f for f in INT8_DOT_FEATURES
               if (f in ("dotprod", "i8mm")) == (built_on.cpu.arch == "aarch64")]
        # Verified on a host with one of them: the engine's products were never checked on
        # the saturating path. (Verified without one, it passed on that path.)
        if (precision.startswith("int8") and config.get("quantize") is not None
                and not config.get("reduce_range")
                and set(dot) & set(built_on.cpu.features)):
            features.append("|".join(dot))
            reasons.append("int8 quantized without reduce_range: u8 x s8 products saturate "
                           "without an int8 dot-product instruction (onnxruntime#5849)")
        if config.get("bf16_fastmath"):
            features.append("bf16")
            reasons.append("MLAS's bf16 fast math needs bf16 instructions")
        return EngineRequirements(
            arch=built_on.cpu.arch,
            isa_level=None if _portable(config) else isa_class(built_on.cpu),
            features=features,
            runtimes={cls.runtime: major_minor(built_on.runtimes.get(cls.runtime)) or ""},
            reasons=reasons)

    @classmethod
    def tuning_context(cls, built_on: HardwareFingerprint, config: Mapping[str, object],
                       requested: str, *, threads_tuned: bool = False) -> TuningContext:
        """Which features decided depends on what raced: int8 dot-product features when int8
        candidates did (``auto``, ``int8``), bf16 when bf16 ones did; thread policies race
        beside fp32 candidates only."""
        context = super().tuning_context(built_on, config, requested,
                                         threads_tuned=threads_tuned)
        depends = set()
        if requested in ("auto", "int8"):
            depends |= set(INT8_DOT_FEATURES)
        if requested in ("auto", "bf16"):
            depends.add("bf16")
        return context.model_copy(update={
            "depends_on": sorted(depends),
            "features": sorted(f for f in depends if f in set(built_on.cpu.features)),
            "threads_tuned": threads_tuned and requested in ("fp32", "auto")})

    @classmethod
    def compatible(
        cls,
        built_on: HardwareFingerprint,
        node: HardwareFingerprint,
        runtime_config: Mapping[str, object] | None = None,
    ) -> bool:
        """Exact key for level-3 (or unknown-level) engines; for levels 0–2, the same
        architecture and the same onnxruntime ``major.minor``."""
        if not (cls.supports(built_on) and cls.supports(node)):
            return False
        if cls.fingerprint_key(built_on) == cls.fingerprint_key(node):
            return True
        if not _portable(runtime_config):
            return False
        return built_on.cpu.arch == node.cpu.arch and major_minor(
            built_on.runtimes.get(cls.runtime)
        ) == major_minor(node.runtimes.get(cls.runtime))

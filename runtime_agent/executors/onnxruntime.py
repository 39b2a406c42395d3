"""Executor twin of ``compiler_worker.backends.onnxruntime``: runs a saved ONNX Runtime model.

``runtime_config`` keys (written by the backend):

- ``graph_optimization_level``: the level the *session* loads the engine with. The backend
  writes 0 (``ORT_DISABLE_ALL``): the engine file already is the optimized graph, and
  re-optimizing it at load would run a graph other than the one that was verified.
- ``providers``: execution providers, in order; each must be available here.
- ``intra_op_num_threads`` / ``inter_op_num_threads``: set only when present.
- ``optimization_level``: the level the engine was built at; it decides portability.
- ``custom_ops``: one entry per custom op in the engine — ``op`` (``domain::OpType``),
  ``kind`` (``python`` or ``native``), ``entry`` (kernel ``module:function`` or library path
  in the bundle), ``plugin`` (bundle sha256) and, for native ones, ``abi``. Before creating
  its session the executor registers the Python kernels with onnxruntime-extensions (and its
  library) and each native library (``register_custom_ops_library``), from the plugins it was
  given (``runtime_agent.plugins.onnxruntime.SessionCustomOps``).

Compatibility. Basic and extended optimizations (levels 1–2) rewrite the graph with standard
ONNX ops and onnxruntime's contrib ops: the saved model runs on any CPU of the same architecture
under the same onnxruntime ``major.minor``. Level 3 adds layout optimizations whose blocking
follows the vector width, so such an engine needs the exact fingerprint key (ISA class and
onnxruntime ``major.minor``). As keys: every supported node has the compatibility key
``ort-cpu-<arch>-portable-ort<major.minor>``; an engine of levels 0–2 carries its build host's
portable key, a level-3 (or unknown-level) engine none.

``onnxruntime`` is imported here and nowhere else in the runtime.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from runtime_agent.executors.base import Executor
from runtime_agent.fingerprint import isa_class, major_minor, slug
from runtime_agent.plugins.abi import runtime_abi
from schemas.errors import BackendUnavailable, InvalidRequest
from schemas.fingerprint import HardwareFingerprint

logger = logging.getLogger(__name__)

#: Build levels whose saved model is hardware-specific (layout optimizations).
HARDWARE_SPECIFIC_LEVEL = 3
SUPPORTED_ARCHES = ("x86_64", "aarch64")

_LEVELS = {
    0: "ORT_DISABLE_ALL",
    1: "ORT_ENABLE_BASIC",
    2: "ORT_ENABLE_EXTENDED",
    3: "ORT_ENABLE_ALL",
}


def _portable(runtime_config: Mapping[str, object] | None) -> bool:
    """Whether the engine's build level (``optimization_level``) leaves it portable."""
    level = (runtime_config or {}).get("optimization_level", HARDWARE_SPECIFIC_LEVEL)
    return isinstance(level, int) and not isinstance(level, bool) and (
        0 <= level < HARDWARE_SPECIFIC_LEVEL)


def session_options(runtime_config: Mapping[str, Any]) -> Any:
    """``onnxruntime.SessionOptions`` for a manifest's ``runtime_config``."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    level = runtime_config.get("graph_optimization_level", 0)
    if level not in _LEVELS:
        raise InvalidRequest(
            f"runtime_config.graph_optimization_level must be one of {sorted(_LEVELS)}; "
            f"got {level!r}"
        )
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, _LEVELS[level])
    for key in ("intra_op_num_threads", "inter_op_num_threads"):
        value = runtime_config.get(key)
        if value is not None:
            setattr(options, key, int(value))
    return options


def check_providers(requested: list[str]) -> list[str]:
    """The requested execution providers, each checked to be available in this onnxruntime."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    missing = [p for p in requested if p not in available]
    if missing or not requested:
        raise BackendUnavailable(
            f"Requested providers were: {requested}, but available providers are: {available}",
            requested=requested,
            available=available,
        )
    return requested


class OnnxRuntimeExecutor(Executor):
    """Loads ``engine.onnx`` into an ``onnxruntime.InferenceSession``."""

    backend = "onnxruntime"
    supports_plugins = True

    @classmethod
    def device_for(cls, runtime_config: Mapping[str, object]) -> str:
        """``cuda`` when the CUDA execution provider comes first, else ``cpu``."""
        providers = runtime_config.get("providers") or ["CPUExecutionProvider"]
        first = next(iter(providers), None) if isinstance(providers, list | tuple) else None
        return "cuda" if first == "CUDAExecutionProvider" else "cpu"

    @classmethod
    def plugin_abi(cls) -> str | None:
        """``<os>-<arch>/ort-api-<N>`` (see ``runtime_agent.plugins.abi``)."""
        return runtime_abi(cls.backend)

    @classmethod
    def supports(cls, fingerprint: HardwareFingerprint) -> bool:
        return (
            fingerprint.cpu.arch in SUPPORTED_ARCHES
            and major_minor(fingerprint.runtimes.onnxruntime) is not None
        )

    @classmethod
    def fingerprint_key(cls, fingerprint: HardwareFingerprint) -> str:
        """``ort-cpu-<ISA class>-ort<major.minor>``, e.g. ``ort-cpu-x86-64-v4-ort1.32``."""
        version = major_minor(fingerprint.runtimes.onnxruntime)
        if version is None:
            raise BackendUnavailable(
                f"the fingerprint names no onnxruntime version "
                f"(runtimes.onnxruntime={fingerprint.runtimes.onnxruntime!r}); "
                f"the {cls.backend} backend needs one"
            )
        return slug(f"ort-cpu-{isa_class(fingerprint.cpu)}-ort{version}")

    @classmethod
    def portable_key(cls, fingerprint: HardwareFingerprint) -> str:
        """``ort-cpu-<arch>-portable-ort<major.minor>``, e.g.
        ``ort-cpu-x86-64-portable-ort1.32``: the key of engines that need only the
        architecture and the onnxruntime version (levels 0–2)."""
        version = major_minor(fingerprint.runtimes.onnxruntime)
        if version is None or not cls.supports(fingerprint):
            raise BackendUnavailable(
                f"the {cls.backend} backend supports {list(SUPPORTED_ARCHES)} with an onnxruntime "
                f"version; the fingerprint has arch {fingerprint.cpu.arch!r} and onnxruntime "
                f"{fingerprint.runtimes.onnxruntime!r}"
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
            built_on.runtimes.onnxruntime
        ) == major_minor(node.runtimes.onnxruntime)

    def _load(self) -> None:
        import onnxruntime as ort

        config = self.manifest.runtime_config
        providers = check_providers(list(config.get("providers", ["CPUExecutionProvider"])))
        path = self.blob_path("engine")
        options = session_options(config)
        custom_ops = list(config.get("custom_ops") or [])
        if custom_ops:
            from runtime_agent.plugins.onnxruntime import SessionCustomOps

            SessionCustomOps.for_artifact(
                custom_ops, self.plugins, self.device_for(config)).apply(options)
        try:
            self.session = ort.InferenceSession(
                str(path), sess_options=options, providers=providers
            )
        except Exception as exc:  # onnxruntime raises its own untyped errors
            raise BackendUnavailable(
                f"onnxruntime {ort.__version__} could not load {path} of artifact "
                f"{self.manifest.artifact_id}: {exc}"
            ) from exc
        logger.debug("loaded %s with providers %s", path, providers)

    def _run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            values = self.session.run(self._output_names, dict(inputs))
        except Exception as exc:  # onnxruntime raises its own untyped errors
            # The feed matched the signature (names, dtypes, ranks, fixed dimensions) and the
            # engine ran on sample inputs before it was served: what remains is almost always
            # an input the graph cannot take (dynamic dimensions that do not agree, indices
            # out of range), so the caller hears onnxruntime's own reason.
            raise InvalidRequest(
                f"the inputs match the signature of artifact {self.manifest.artifact_id}, but "
                f"onnxruntime could not run them: {exc}",
                artifact_id=self.manifest.artifact_id,
            ) from exc
        return dict(zip(self._output_names, values, strict=True))

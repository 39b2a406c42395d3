"""ONNX Runtime (CPU) backend: saves the model onnxruntime optimized at the requested level.

Levels: 0 ``ORT_DISABLE_ALL``, 1 ``ORT_ENABLE_BASIC``, 2 ``ORT_ENABLE_EXTENDED``,
3 ``ORT_ENABLE_ALL``.

Portability. Basic and extended optimizations rewrite the graph with standard ONNX ops and
onnxruntime's own contrib ops (``FusedConv``, ``LayerNormalization``, ...): the saved model runs
on any CPU of the same architecture under the same onnxruntime ``major.minor``. Level 3 adds
layout optimizations (``com.microsoft.nchwc`` blocked convolutions whose block size follows the
vector width) — onnxruntime warns that such a model "should only be used in the same environment
the model was optimized in". Hence the fingerprint key carries the ISA class, and
``compatible()`` asks for the exact key at level 3; engines of levels 0–2 carry the
compatibility key ``ort-cpu-<arch>-portable-ort<major.minor>``. These rules (``supports``,
``fingerprint_key``, ``compatibility_key``, ``compatible``) are defined once, in the executor
twin ``runtime_agent.executors.onnxruntime``, so an agent computes the same keys.

Loading. The saved engine already is the optimized graph, so ``runtime_config`` tells the
executor to load it with ``ORT_DISABLE_ALL`` (``graph_optimization_level: 0``): re-optimizing at
load time would cost start-up time and run a graph other than the one Kiln verified. The level
the engine was built at is kept as ``optimization_level``.

Precision: this backend builds fp32 engines only; fp16/bf16 on CPU are refused with
``BackendUnavailable`` rather than silently built as fp32.

Custom ops. ``build(..., custom_ops=SessionCustomOps)`` registers the plugins' Python kernels
(through onnxruntime-extensions) and native libraries with the optimizing session, exactly as
the executor will, and records them in ``runtime_config["custom_ops"]``. onnxruntime keeps
custom nodes as they are: its fusions match only the operators they know, so none crosses a
custom node, while constant folding and fusions around it still apply.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING

from compiler_worker.backends.base import Backend, BuiltEngine, major_minor, toolchain_string
from runtime_agent.executors.onnxruntime import OnnxRuntimeExecutor
from runtime_agent.fingerprint import onnxruntime_version
from schemas.errors import BackendUnavailable, CompileError, FingerprintMismatch
from schemas.fingerprint import HardwareFingerprint
from schemas.options import CompileOptions, Precision

if TYPE_CHECKING:
    from runtime_agent.plugins.onnxruntime import SessionCustomOps

logger = logging.getLogger(__name__)

#: The custom ops of the build in progress (``build(custom_ops=...)`` → ``_build``).
_CUSTOM_OPS: ContextVar[SessionCustomOps | None] = ContextVar("kiln_ort_custom_ops",
                                                                default=None)

PROVIDERS = ["CPUExecutionProvider"]
ENGINE_MEDIA_TYPE = "application/x-onnx"
LEVEL_NAMES = {
    0: "ORT_DISABLE_ALL",
    1: "ORT_ENABLE_BASIC",
    2: "ORT_ENABLE_EXTENDED",
    3: "ORT_ENABLE_ALL",
}


def installed_version() -> str | None:
    """The onnxruntime version installed here (package metadata; nothing is imported)."""
    return onnxruntime_version()


class OnnxRuntimeBackend(Backend):
    """onnxruntime's CPU execution provider; keyed by ISA class and onnxruntime major.minor."""

    name = "onnxruntime"
    executor = OnnxRuntimeExecutor
    priority = 10
    #: The device this backend builds for (the one whose custom-op implementations it needs).
    device = "cpu"
    accepts_plugins = True

    def build(
        self,
        model_path: Path,
        options: CompileOptions,
        workdir: Path,
        *,
        fingerprint: HardwareFingerprint | None = None,
        custom_ops: SessionCustomOps | None = None,
    ) -> BuiltEngine:
        """``Backend.build``, with the model's custom ops registered in the session."""
        token = _CUSTOM_OPS.set(custom_ops)
        try:
            return super().build(model_path, options, workdir, fingerprint=fingerprint)
        finally:
            _CUSTOM_OPS.reset(token)

    def compatibility_key(
        self,
        fingerprint: HardwareFingerprint,
        options: CompileOptions,
        runtime_config: Mapping[str, object],
    ) -> str | None:
        """The build host's portable key (``ort-cpu-<arch>-portable-ort<major.minor>``) for
        levels 0–2, ``None`` for level 3; the level is ``runtime_config``'s
        ``optimization_level`` (``options.optimization_level`` when absent)."""
        config = {"optimization_level": options.optimization_level, **runtime_config}
        return OnnxRuntimeExecutor.compatibility_key(fingerprint, config)

    def portable_key(self, fingerprint: HardwareFingerprint) -> str | None:
        """``ort-cpu-<arch>-portable-ort<major.minor>``: engines of levels 0–2 carry it."""
        return OnnxRuntimeExecutor.portable_key(fingerprint) if self.supports(fingerprint) \
            else None

    def toolchain(self) -> str:
        version = installed_version()
        if version is None:
            raise BackendUnavailable("onnxruntime is not installed on this worker")
        return toolchain_string(self.name, version)

    def check_options(self, options: CompileOptions) -> None:
        if options.precision is not Precision.FP32:
            raise BackendUnavailable(
                f"the {self.name} CPU backend builds fp32 engines only; precision "
                f"{options.precision.value} was requested (use precision fp32, or a GPU backend "
                f"such as tensorrt for fp16/bf16)",
                precision=options.precision.value,
                supported=[Precision.FP32.value],
            )

    def _build(
        self,
        model_path: Path,
        options: CompileOptions,
        workdir: Path,
        *,
        fingerprint: HardwareFingerprint | None,
    ) -> BuiltEngine:
        import onnxruntime as ort

        if fingerprint is not None:
            declared = major_minor(fingerprint.runtimes.onnxruntime)
            if declared != major_minor(ort.__version__):
                raise FingerprintMismatch(
                    f"the build fingerprint declares onnxruntime "
                    f"{fingerprint.runtimes.onnxruntime}, but this worker runs onnxruntime "
                    f"{ort.__version__}; an engine built here would carry the wrong key"
                )
        if "CPUExecutionProvider" not in ort.get_available_providers():
            raise BackendUnavailable(
                f"Requested providers were: {PROVIDERS}, but available providers are: "
                f"{ort.get_available_providers()}"
            )
        level = options.optimization_level
        engine_path = workdir / "engine.onnx"
        session_options = ort.SessionOptions()
        session_options.graph_optimization_level = getattr(
            ort.GraphOptimizationLevel, LEVEL_NAMES[level]
        )
        session_options.optimized_model_filepath = str(engine_path)
        # Level 3 makes onnxruntime warn that the saved model is hardware-specific; that is
        # by design here (see the module docstring), so only errors are logged.
        session_options.log_severity_level = 3
        custom_ops = _CUSTOM_OPS.get()
        if custom_ops:
            custom_ops.apply(session_options)
        try:
            ort.InferenceSession(str(model_path), session_options, providers=PROVIDERS)
        except Exception as exc:  # onnxruntime raises its own untyped errors
            raise CompileError(
                f"onnxruntime {ort.__version__} could not build the model at level {level} "
                f"({LEVEL_NAMES[level]}): {exc}",
                optimization_level=level,
            ) from exc
        logger.info("onnxruntime saved the %s model to %s", LEVEL_NAMES[level], engine_path)
        runtime_config: dict[str, object] = {
            "graph_optimization_level": 0,
            "optimization_level": level,
            "providers": list(PROVIDERS),
        }
        if custom_ops:
            runtime_config["custom_ops"] = custom_ops.runtime_config()
            _check_custom_nodes(model_path, engine_path)
        return BuiltEngine(
            blobs=[("engine", engine_path, ENGINE_MEDIA_TYPE)],
            runtime_config=runtime_config,
            toolchain=toolchain_string(self.name, ort.__version__),
        )


def _custom_node_counts(path: Path) -> dict[str, int]:
    import onnx

    from schemas.onnx_model import BUILTIN_DOMAINS
    from schemas.plugins import qualified_op

    counts: dict[str, int] = {}
    for node in onnx.load(str(path), load_external_data=False).graph.node:
        if node.domain not in BUILTIN_DOMAINS and not node.domain.startswith("com.microsoft"):
            name = qualified_op(node.domain, node.op_type)
            counts[name] = counts.get(name, 0) + 1
    return counts


def _check_custom_nodes(model_path: Path, engine_path: Path) -> None:
    """Custom nodes stay opaque: onnxruntime neither fuses nor folds them. Log what the engine
    kept, and warn when a node is gone (only dead code may be removed)."""
    before, after = _custom_node_counts(model_path), _custom_node_counts(engine_path)
    logger.info("custom nodes in the engine: %s (before optimization: %s)", after, before)
    lost = {op: (n, after.get(op, 0)) for op, n in before.items() if after.get(op, 0) < n}
    if lost:
        logger.warning("onnxruntime removed custom nodes (op: before, after) %s; only nodes "
                       "whose outputs nothing uses should disappear", lost)

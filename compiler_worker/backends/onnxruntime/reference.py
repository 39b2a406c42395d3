"""ONNX Runtime as the verification reference for ONNX models: the model as submitted on the
CPU provider with every graph optimization disabled (``ORT_DISABLE_ALL``), with the plugins'
CPU kernels registered for its custom ops. ``compiler_worker.verify`` compares an engine with
whatever runner this gives; the pipeline finds it through the backend registry
(``backends.reference_for``), so nothing else names the runtime.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import onnx

from schemas.errors import CompileError, KilnError

if TYPE_CHECKING:
    from runtime_agent.executors.onnxruntime.custom_ops import SessionCustomOps
    from runtime_agent.plugins import LoadedPlugin

__all__ = ["REFERENCE_TARGET", "OnnxRuntimeReference", "reference_custom_ops",
           "reference_runner"]

logger = logging.getLogger(__name__)

#: Where the verification reference runs a model's custom ops: (plugin backend, device).
REFERENCE_TARGET = ("onnxruntime", "cpu")


class OnnxRuntimeReference:
    """The reference runner: a model on onnxruntime's CPU provider, optimizations disabled."""

    def __init__(self, model: onnx.ModelProto, output_names: list[str], description: str,
                 custom_ops: SessionCustomOps | None = None) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        options.log_severity_level = 3
        if custom_ops:
            custom_ops.apply(options)
            description += " with the plugins' custom ops"
        self.session = ort.InferenceSession(
            model.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
        self.output_names = output_names
        self.name = f"onnxruntime {ort.__version__} CPUExecutionProvider ORT_DISABLE_ALL on " \
                    f"{description}"

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            values = self.session.run(self.output_names, dict(inputs))
        except Exception as exc:  # onnxruntime raises its own untyped errors
            raise CompileError(
                f"the reference ({self.name}) cannot run on inputs "
                f"{ {k: (str(v.dtype), list(v.shape)) for k, v in inputs.items()} }: {exc}"
            ) from exc
        return dict(zip(self.output_names, values, strict=True))


def reference_custom_ops(plugins: Sequence[LoadedPlugin],
                         ops: Iterable[str]) -> SessionCustomOps | None:
    """What the reference session registers for the model's custom ops: the plugins' CPU
    kernels, whatever backend the engine is built for (the reference always runs on
    onnxruntime's CPU provider)."""
    if not plugins:
        return None
    from runtime_agent.executors.onnxruntime.custom_ops import SessionCustomOps

    return SessionCustomOps.resolve(list(plugins), set(ops), "cpu")


def reference_runner(
    submitted: onnx.ModelProto, prepared: onnx.ModelProto, output_names: list[str],
    custom_ops: SessionCustomOps | None = None,
) -> OnnxRuntimeReference:
    """The reference for verification: the submitted model, or — only when onnxruntime cannot
    load it (an opset older than it supports) — the model after Kiln's passes, which the
    reference name then says. ``custom_ops`` are registered with its session."""
    try:
        return OnnxRuntimeReference(submitted, output_names, "the submitted model", custom_ops)
    except KilnError:  # the plugins, not the model: nothing to fall back on
        raise
    except Exception as exc:  # onnxruntime raises its own untyped errors
        logger.warning("onnxruntime cannot load the submitted model (%s); the reference is the "
                       "model after Kiln's passes", exc)
        try:
            return OnnxRuntimeReference(
                prepared, output_names,
                "the model after Kiln's passes (onnxruntime cannot load the submitted one)",
                custom_ops,
            )
        except Exception as exc2:
            raise CompileError(
                f"onnxruntime cannot run the model as a reference: {exc2}"
            ) from exc2

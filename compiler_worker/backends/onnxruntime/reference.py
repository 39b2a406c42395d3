"""ONNX Runtime as the verification reference for ONNX models: the model as submitted on the
CPU provider with every graph optimization disabled (``ORT_DISABLE_ALL``), with the plugins'
CPU kernels registered for its custom ops. ``compiler_worker.verify`` compares an engine with
whatever runner this gives; the pipeline finds it through the backend registry
(``backends.reference_for``), so nothing else names the runtime. The runner itself is the run
side's (``runtime_agent.executors.onnxruntime.reference``); this adds what only a build has:
the plugins' kernels and the fallback to the model after Kiln's passes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import onnx

from runtime_agent.executors.onnxruntime.reference import OnnxRuntimeReference
from schemas.errors import CompileError, KilnError

if TYPE_CHECKING:
    from runtime_agent.executors.onnxruntime.custom_ops import SessionCustomOps
    from runtime_agent.plugins import LoadedPlugin

__all__ = ["REFERENCE_TARGET", "OnnxRuntimeReference", "reference_custom_ops",
           "reference_runner"]

logger = logging.getLogger(__name__)

#: Where the verification reference runs a model's custom ops: (plugin backend, device).
REFERENCE_TARGET = ("onnxruntime", "cpu")


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

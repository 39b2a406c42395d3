"""ONNX Runtime as the reference for ONNX models: the model as submitted, on the CPU provider
with every graph optimization disabled (``ORT_DISABLE_ALL``). The build side verifies engines
against it (``compiler_worker.backends.onnxruntime.reference`` adds the plugins' kernels and the
fallback to the prepared model); anything on the run side that checks an answer (``kiln demo``)
finds it through ``runtime_agent.executors.reference_for``, so nothing else names the runtime.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from schemas.errors import CompileError

if TYPE_CHECKING:
    import onnx

    from runtime_agent.executors.onnxruntime.custom_ops import SessionCustomOps

__all__ = ["OnnxRuntimeReference"]


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

"""``check``: the ONNX checker with full (strict) shape and type inference."""

from __future__ import annotations

import onnx
from onnx import checker, shape_inference

from compiler_worker.passes.base import Pass
from schemas.errors import ModelCheckFailed
from schemas.jobs import JobStage


class CheckModel(Pass):
    """Reject a model the ONNX checker (or strict shape inference) rejects.

    Inference runs for checking only: the returned model is the submitted graph with the
    inferred types and shapes of its *graph outputs* filled in (so the signature Kiln reports,
    and agents validate against, is as precise as the graph allows), but none of the inferred
    intermediate ``value_info``. Those annotations belong to the model's opset as it is now; a
    later pass that rewrites nodes (an opset conversion) would otherwise carry stale ones into
    the graph that gets built.
    """

    name = "check"
    stage = JobStage.CHECKING

    def run(self, model: onnx.ModelProto) -> onnx.ModelProto:
        try:
            checker.check_model(model, full_check=True)
            inferred = shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
        except (checker.ValidationError, shape_inference.InferenceError) as exc:
            raise ModelCheckFailed(
                f"the ONNX checker rejected the model: {exc}", checker_message=str(exc)
            ) from exc
        outputs = {value.name: value for value in inferred.graph.output}
        for value in model.graph.output:
            found = outputs.get(value.name)
            if found is not None:
                value.CopyFrom(found)
        return model

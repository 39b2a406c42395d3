"""``check``: the ONNX checker with full (strict) shape and type inference."""

from __future__ import annotations

import onnx
from onnx import checker, shape_inference

from compiler_worker.passes.base import Pass
from schemas.errors import ModelCheckFailed
from schemas.jobs import JobStage


class CheckModel(Pass):
    """Reject a model the ONNX checker rejects; return it with inferred shapes.

    Inferring shapes here fills in output shapes that a model leaves out, so the signature
    Kiln reports (and agents validate against) is as precise as the graph allows.
    """

    name = "check"
    stage = JobStage.CHECKING

    def run(self, model: onnx.ModelProto) -> onnx.ModelProto:
        try:
            checker.check_model(model, full_check=True)
            return shape_inference.infer_shapes(
                model, check_type=True, strict_mode=True
            )
        except (checker.ValidationError, shape_inference.InferenceError) as exc:
            raise ModelCheckFailed(
                f"the ONNX checker rejected the model: {exc}", checker_message=str(exc)
            ) from exc

"""``check``: the ONNX checker with full (strict) shape and type inference."""

from __future__ import annotations

import logging
import re

import onnx
from onnx import checker, defs, shape_inference

from compiler_worker.passes.base import Pass
from schemas.errors import ModelCheckFailed
from schemas.jobs import JobStage

logger = logging.getLogger(__name__)

_FAILING_OP = re.compile(r"\(op_type:([A-Za-z0-9_]+)")


class CheckModel(Pass):
    """Reject a model the ONNX checker (or strict shape inference) rejects.

    Inference runs for checking only: the returned model is the submitted graph with the
    inferred types and shapes of its *graph outputs* filled in (so the signature Kiln reports,
    and agents validate against, is as precise as the graph allows), but none of the inferred
    intermediate ``value_info``. Those annotations belong to the model's opset as it is now; a
    later pass that rewrites nodes (an opset conversion) would otherwise carry stale ones into
    the graph that gets built.

    One leniency: when strict inference fails only *inside the function body ONNX itself
    defines* for an operator (e.g. ``MeanVarianceNormalization``-13, whose body carries a
    ``Constant`` strict inference rejects), the defect is ONNX's, not the model's, and backends
    run such operators natively: the model passes (the structural checker still ran) with a
    warning, its outputs inferred non-strictly.
    """

    name = "check"
    stage = JobStage.CHECKING

    def run(self, model: onnx.ModelProto) -> onnx.ModelProto:
        try:
            checker.check_model(model, full_check=False)
            inferred = shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
        except (checker.ValidationError, shape_inference.InferenceError) as exc:
            if not _only_function_bodies_fail(model, str(exc)):
                raise ModelCheckFailed(
                    f"the ONNX checker rejected the model: {exc}", checker_message=str(exc)
                ) from exc
            logger.warning("strict shape inference fails inside ONNX's own function bodies "
                           "(%s); the model is kept", " ".join(str(exc).split())[:300])
            self.detail = "ONNX function-body inference error ignored"
            inferred = shape_inference.infer_shapes(model, check_type=True)
        outputs = {value.name: value for value in inferred.graph.output}
        for value in model.graph.output:
            found = outputs.get(value.name)
            if found is not None:
                value.CopyFrom(found)
        return model


def _only_function_bodies_fail(model: onnx.ModelProto, message: str) -> bool:
    """Whether every operator named in the inference error is a default-domain op that ONNX
    defines by a function body, and the error comes from inside such a body (a nested
    ``(op_type:...)`` after the outer one)."""
    if "[ShapeInferenceError]" not in message:
        return False
    opsets = {o.domain or "": o.version for o in model.opset_import}
    used = {n.op_type for n in model.graph.node if n.domain in ("", "ai.onnx")}
    lines = [line for line in message.splitlines() if "(op_type:" in line]
    if not lines:
        return False
    for line in lines:
        ops = _FAILING_OP.findall(line)
        if len(ops) < 2 or ops[0] not in used:  # the node's own error, not its body's
            return False
        try:
            schema = defs.get_schema(ops[0], opsets.get("", 1))
        except defs.SchemaError:
            return False
        if not (schema.has_function or schema.has_context_dependent_function):
            return False
    return True

"""``upgrade_opset``: convert a model only when its opset is older than the backends accept.

onnxruntime refuses models whose default-domain (``ai.onnx``) opset is below 7, so Kiln
converts such a model to opset ``minimum`` (7 by default, a parameter of the pass) and leaves
every other model exactly as submitted: converting a model the backends already run only adds
risk (an adapter that changes numerics, stale ``value_info``), never speed.

A conversion is checked, not trusted: ONNX's reference evaluator (``onnx.reference``, which
runs the old opsets onnxruntime refuses) runs the original and the converted graph on
generated inputs, and the pass fails with ``ModelCheckFailed`` when their outputs differ
beyond tolerance. The pass then reports what it did (``detail``), which the pipeline records
in its applied list.

``value_info`` annotations are dropped before converting: they were inferred for the old
opset (an opset-9 ``Dropout`` mask is float, an opset-12 one bool) and would contradict the
converted nodes.

One adapter ONNX's converter lacks is added here: before opset 7, ``PRelu`` applied a 1-D slope
of ``C`` values per channel (axis 1, as PyTorch's ``PReLU(C)`` means); from opset 7 on the
slope broadcasts numpy-style from the last axis. A converted model gets such a slope reshaped
to ``[C, 1, ...]`` so it keeps meaning per channel.
"""

from __future__ import annotations

import logging

import onnx
from onnx import checker, helper, numpy_helper, shape_inference, version_converter

from compiler_worker.modelio import default_opset
from compiler_worker.passes.base import Pass
from schemas.errors import UnsupportedOpset

logger = logging.getLogger(__name__)

#: The oldest default-domain opset onnxruntime loads.
MIN_OPSET = 7


class UpgradeOpset(Pass):
    """Convert the default domain to ``target`` when the model's opset is below ``minimum``;
    check the conversion against the original with the ONNX reference evaluator
    (``verify=False`` skips that check)."""

    name = "upgrade_opset"

    def __init__(self, minimum: int = MIN_OPSET, target: int | None = None, *,
                 verify: bool = True) -> None:
        self.minimum = minimum
        self.target = target if target is not None else minimum
        if self.target < self.minimum:
            raise ValueError(f"target opset {self.target} is below the minimum {self.minimum}")
        self.verify = verify

    def run(self, model: onnx.ModelProto) -> onnx.ModelProto:
        self.detail = None
        current = default_opset(model)
        if current >= self.minimum:
            return model
        original = model
        try:
            stripped = onnx.ModelProto()
            stripped.CopyFrom(model)
            del stripped.graph.value_info[:]
            adapted = _prelu_slopes_per_channel(stripped) if current < 7 else []
            converted = version_converter.convert_version(stripped, self.target)
            min_ir = helper.find_min_ir_version_for(
                list(converted.opset_import), ignore_unknown=True
            )
            converted.ir_version = max(converted.ir_version, min_ir)
            checker.check_model(converted)
        except Exception as exc:  # the converter raises untyped RuntimeErrors per adapter
            raise UnsupportedOpset(
                f"cannot convert the model from opset {current} to opset {self.target} "
                f"(the backends need at least {self.minimum}): {exc}",
                from_opset=current,
                to_opset=self.target,
            ) from exc
        detail = f"opset {current}->{self.target}"
        if adapted:
            detail += f", PRelu slopes {adapted} per channel"
        if self.verify:
            from compiler_worker.verify import check_conversion

            report = check_conversion(original, converted,
                                      what=f"opset {current} -> {self.target} conversion")
            detail += f", {report}"
        self.detail = detail
        logger.info("converted the model from opset %d to %d (%s)", current, self.target, detail)
        return converted

    def __repr__(self) -> str:
        return f"UpgradeOpset(minimum={self.minimum}, target={self.target})"


def _prelu_slopes_per_channel(model: onnx.ModelProto) -> list[str]:
    """Reshape every 1-D multi-value PRelu slope initializer to ``[C, 1, ...]`` (in place) where
    the input has rank > 2 and ``C`` channels; returns the slopes reshaped."""
    nodes = [n for n in model.graph.node if n.op_type == "PRelu" and n.domain in ("", "ai.onnx")
             and len(n.input) == 2]
    if not nodes:
        return []
    inferred = shape_inference.infer_shapes(model)
    shapes = {v.name: v.type.tensor_type.shape for v in
              [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]
              if v.type.tensor_type.HasField("shape")}
    weights = {init.name: init for init in model.graph.initializer}
    reshaped: list[str] = []
    for node in nodes:
        slope, shape = weights.get(node.input[1]), shapes.get(node.input[0])
        if slope is None or shape is None or len(slope.dims) != 1 or slope.dims[0] == 1:
            continue
        rank, channels = len(shape.dim), slope.dims[0]
        if rank <= 2 or (shape.dim[1].HasField("dim_value")
                         and shape.dim[1].dim_value != channels):
            continue
        array = numpy_helper.to_array(slope).reshape([channels] + [1] * (rank - 2))
        name = f"{slope.name}_per_channel"
        if name not in weights:
            weights[name] = numpy_helper.from_array(array, name)
            model.graph.initializer.append(weights[name])
            if model.ir_version < 4:  # every initializer is a graph input too
                model.graph.input.append(helper.make_tensor_value_info(
                    name, slope.data_type, list(array.shape)))
        node.input[1] = name
        reshaped.append(slope.name)
    return reshaped

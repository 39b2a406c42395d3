"""``upgrade_opset``: convert old models to the opset the backends run well.

Kiln upgrades a model whose default-domain opset is below 13 to opset 13. Opset 13 is where
the operator set settled into the form today's optimizers and parsers target (``Split``,
``Squeeze``, ``Unsqueeze`` and ``ReduceSum`` take their axes as inputs, bf16 types exist, the
quantization ops are per-axis); onnxruntime's fusions and TensorRT's ONNX parser match those
forms best. Models at 13 or above are left alone: converting further only adds risk.
"""

from __future__ import annotations

import logging

import onnx
from onnx import checker, helper, version_converter

from compiler_worker.modelio import default_opset
from compiler_worker.passes.base import Pass
from schemas.errors import UnsupportedOpset

logger = logging.getLogger(__name__)

MIN_OPSET = 13


class UpgradeOpset(Pass):
    """Convert the default domain to ``target`` when the model's opset is below ``minimum``."""

    name = "upgrade_opset"

    def __init__(self, minimum: int = MIN_OPSET, target: int | None = None) -> None:
        self.minimum = minimum
        self.target = target if target is not None else minimum

    def run(self, model: onnx.ModelProto) -> onnx.ModelProto:
        current = default_opset(model)
        if current >= self.minimum:
            return model
        try:
            converted = version_converter.convert_version(model, self.target)
            min_ir = helper.find_min_ir_version_for(
                list(converted.opset_import), ignore_unknown=True
            )
            converted.ir_version = max(converted.ir_version, min_ir)
            checker.check_model(converted)
        except Exception as exc:  # the converter raises untyped RuntimeErrors per adapter
            raise UnsupportedOpset(
                f"cannot convert the model from opset {current} to opset {self.target} "
                f"(Kiln needs at least {self.minimum}): {exc}",
                from_opset=current,
                to_opset=self.target,
            ) from exc
        logger.info("converted the model from opset %d to %d", current, self.target)
        return converted

    def __repr__(self) -> str:
        return f"UpgradeOpset(minimum={self.minimum}, target={self.target})"

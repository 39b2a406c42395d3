"""Graph passes, one per module, and the default pipeline Kiln runs before a backend build.

Order: ``check`` and ``custom_op_shapes`` (stage CHECKING), then ``upgrade_opset`` and
``strip_initializer_inputs`` (stage OPTIMIZING). Backends run their own optimizers in ``build``.
``custom_op_shapes`` infers custom ops' outputs with the shape functions of the plugins given
(a no-op for a model without custom ops).
"""

from __future__ import annotations

from collections.abc import Iterable

from compiler_worker.passes.base import Pass, PassPipeline
from compiler_worker.passes.check import CheckModel
from compiler_worker.passes.custom_op_shapes import CustomOpShapes
from compiler_worker.passes.strip_initializer_inputs import StripInitializerInputs
from compiler_worker.passes.upgrade_opset import MIN_OPSET, UpgradeOpset
from runtime_agent.plugins import OpRegistry

__all__ = [
    "MIN_OPSET",
    "CheckModel",
    "CustomOpShapes",
    "Pass",
    "PassPipeline",
    "StripInitializerInputs",
    "UpgradeOpset",
    "default_passes",
    "default_pipeline",
]


def default_passes(custom_ops: OpRegistry | None = None) -> list[Pass]:
    """Fresh instances of the passes Kiln runs, in order (``custom_ops``: the ops of the
    plugins the model is compiled with)."""
    return [CheckModel(), CustomOpShapes(custom_ops), UpgradeOpset(), StripInitializerInputs()]


def default_pipeline(disabled: Iterable[str] = (),
                     custom_ops: OpRegistry | None = None) -> PassPipeline:
    """The default passes with ``disabled`` names skipped (unknown names raise InvalidOptions)."""
    return PassPipeline(default_passes(custom_ops), disabled=disabled)

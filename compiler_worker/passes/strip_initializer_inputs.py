"""``strip_initializer_inputs``: weights listed as graph inputs stop being inputs.

Before IR version 4 every initializer had to be listed as a graph input too; from IR 4 on, an
initializer that is also an input is an *overridable* default. Either way Kiln treats weights
as constants: listed as inputs they would be mistaken for real inputs, and onnxruntime does not
constant-fold or fuse overridable initializers.
"""

from __future__ import annotations

import logging

import onnx

from compiler_worker.passes.base import Pass

logger = logging.getLogger(__name__)

#: The first IR version in which an initializer need not be a graph input.
IR_VERSION_INITIALIZERS_NOT_INPUTS = 4


class StripInitializerInputs(Pass):
    """Remove graph inputs that are initializers; raise the IR version to at least 4."""

    name = "strip_initializer_inputs"

    def run(self, model: onnx.ModelProto) -> onnx.ModelProto:
        weights = {init.name for init in model.graph.initializer}
        keep = [value for value in model.graph.input if value.name not in weights]
        removed = len(model.graph.input) - len(keep)
        if removed:
            del model.graph.input[:]
            model.graph.input.extend(keep)
            model.ir_version = max(model.ir_version, IR_VERSION_INITIALIZERS_NOT_INPUTS)
            logger.info("removed %d initializer(s) from the graph inputs", removed)
        return model

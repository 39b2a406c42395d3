"""``custom_op_shapes``: shape and type inference through the custom ops' shape functions.

ONNX's shape inference knows nothing about a custom op: it leaves the op's outputs untyped,
and with them everything downstream. This pass alternates the two: ONNX inference, then every
custom node whose inputs are now typed gets its outputs from its op's shape function (written
into ``value_info``, or checked against and merged into a graph output the model declares);
until no node is left or none makes progress. Each custom node's input dtypes are checked
against its op's signature on the way. Shape functions only read types, so nothing runs on a
device. Only the main graph's custom nodes are inferred (subgraphs keep ONNX's inference).

Custom nodes stay opaque to every later stage: Kiln rewrites none of them, and onnxruntime
optimizes only the operators it knows — no fusion crosses a custom node, while constant
folding and fusions around it (the convolution before it, weights feeding it) still happen.

The module also holds ``fill_attribute_defaults``, which the pipeline applies to the submitted
model before anything else: every custom node gets every attribute its op declares, defaults
written out, types checked. (onnxruntime-extensions reads every declared attribute from every
node; writing defaults out keeps the engine and the reference running the same graph.)
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, shape_inference

from compiler_worker.passes.base import Pass
from runtime_agent.plugins import OpRegistry, TensorType, resolve_attributes
from schemas.errors import InvalidRequest, ModelCheckFailed
from schemas.jobs import JobStage
from schemas.onnx_model import BUILTIN_DOMAINS
from schemas.plugins import qualified_op

logger = logging.getLogger(__name__)

__all__ = ["CustomOpShapes", "fill_attribute_defaults", "node_attributes", "tensor_type"]


def _is_custom(node: onnx.NodeProto) -> bool:
    return node.domain not in BUILTIN_DOMAINS


def _describe(node: onnx.NodeProto) -> str:
    name = f" {node.name!r}" if node.name else ""
    return f"node{name} ({qualified_op(node.domain, node.op_type)} -> {list(node.output)})"


def node_attributes(node: onnx.NodeProto) -> dict[str, Any]:
    """A node's attributes as Python values (strings decoded, repeated fields as lists)."""
    values: dict[str, Any] = {}
    for attribute in node.attribute:
        value = helper.get_attribute_value(attribute)
        if isinstance(value, bytes):
            value = value.decode()
        elif isinstance(value, list):
            value = [v.decode() if isinstance(v, bytes) else v for v in value]
        values[attribute.name] = value
    return values


def _dtype_name(elem_type: int) -> str:
    if elem_type == TensorProto.STRING:
        return "string"
    return helper.tensor_dtype_to_np_dtype(elem_type).name


def _elem_type(dtype: str) -> int:
    if dtype == "string":
        return TensorProto.STRING
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def tensor_type(value: onnx.ValueInfoProto | onnx.TypeProto) -> TensorType | None:
    """A value's ``TensorType`` (``None`` when it has no known tensor element type)."""
    proto = value.type if isinstance(value, onnx.ValueInfoProto) else value
    if not proto.HasField("tensor_type") or not proto.tensor_type.elem_type:
        return None
    tensor = proto.tensor_type
    if not tensor.HasField("shape"):
        return TensorType(_dtype_name(tensor.elem_type), None)
    dims: list[int | str | None] = []
    for dim in tensor.shape.dim:
        if dim.HasField("dim_value"):
            dims.append(dim.dim_value)
        elif dim.HasField("dim_param") and dim.dim_param:
            dims.append(dim.dim_param)
        else:
            dims.append(None)
    return TensorType(_dtype_name(tensor.elem_type), tuple(dims))


def _type_proto(t: TensorType) -> onnx.TypeProto:
    return helper.make_tensor_type_proto(
        _elem_type(t.dtype), None if t.shape is None else list(t.shape))


def _known_types(graph: onnx.GraphProto) -> dict[str, TensorType]:
    types: dict[str, TensorType] = {}
    for init in graph.initializer:
        types[init.name] = TensorType(_dtype_name(init.data_type), tuple(init.dims))
    for value in [*graph.input, *graph.value_info, *graph.output]:
        found = tensor_type(value)
        if found is not None:
            types[value.name] = found
    return types


def fill_attribute_defaults(model: onnx.ModelProto, registry: OpRegistry) -> onnx.ModelProto:
    """A copy of ``model`` whose custom nodes (main graph) carry every attribute their op
    declares, defaults written out; an undeclared, missing required or ill-typed attribute
    raises ``ModelCheckFailed`` naming the node."""
    result = onnx.ModelProto()
    result.CopyFrom(model)
    for node in result.graph.node:
        if not _is_custom(node):
            continue
        definition = registry.get(qualified_op(node.domain, node.op_type))
        try:
            values = resolve_attributes(definition.spec, node_attributes(node))
        except InvalidRequest as exc:
            raise ModelCheckFailed(f"{_describe(node)}: {exc.message}", node=node.name,
                                   **exc.details) from exc
        present = {a.name for a in node.attribute}
        for spec in definition.spec.attributes:
            if spec.name in values and spec.name not in present:
                node.attribute.append(helper.make_attribute(spec.name, values[spec.name]))
    return result


def _check_inputs(node: onnx.NodeProto, registry: OpRegistry,
                  types: list[TensorType | None]) -> None:
    spec = registry.get(qualified_op(node.domain, node.op_type)).spec
    if len(node.input) > len(spec.inputs) or len(node.output) > len(spec.outputs):
        raise ModelCheckFailed(
            f"{_describe(node)} has {len(node.input)} input(s) and {len(node.output)} "
            f"output(s); op {spec.qualified_name} declares inputs {[a.name for a in spec.inputs]} "
            f"and outputs {[a.name for a in spec.outputs]}", node=node.name)
    for index, arg in enumerate(spec.inputs):
        found = types[index] if index < len(types) else None
        if found is None:
            if not arg.optional:
                raise ModelCheckFailed(f"{_describe(node)}: input {arg.name!r} of op "
                                       f"{spec.qualified_name} is required", node=node.name)
            continue
        if found.dtype not in arg.dtypes:
            raise ModelCheckFailed(
                f"{_describe(node)}: input {arg.name!r} is {found.dtype}; op "
                f"{spec.qualified_name} takes {arg.dtypes}", node=node.name)


def _merge(declared: TensorType, inferred: TensorType, name: str,
           node: onnx.NodeProto) -> TensorType:
    """A graph output's declared type, completed by the inferred one; a conflict raises."""
    if declared.dtype != inferred.dtype or (
            declared.shape is not None and inferred.shape is not None
            and (len(declared.shape) != len(inferred.shape) or any(
                isinstance(a, int) and isinstance(b, int) and a != b
                for a, b in zip(declared.shape, inferred.shape, strict=True)))):
        raise ModelCheckFailed(
            f"the model declares output {name!r} as {declared}; the shape function of "
            f"{_describe(node)} gives {inferred}", output=name)
    if declared.shape is None:
        return inferred
    if inferred.shape is None:
        return declared
    return TensorType(declared.dtype, tuple(
        d if d is not None else i for d, i in zip(declared.shape, inferred.shape, strict=True)))


def _set_type(graph: onnx.GraphProto, name: str, inferred: TensorType,
              node: onnx.NodeProto) -> None:
    for output in graph.output:
        if output.name == name:
            declared = tensor_type(output)
            merged = inferred if declared is None else _merge(declared, inferred, name, node)
            output.type.CopyFrom(_type_proto(merged))
            return
    for value in graph.value_info:
        if value.name == name:
            value.type.CopyFrom(_type_proto(inferred))
            return
    graph.value_info.append(helper.make_value_info(name, _type_proto(inferred)))


def _infer(model: onnx.ModelProto) -> onnx.ModelProto:
    try:
        return shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    except shape_inference.InferenceError as exc:
        raise ModelCheckFailed(
            f"shape inference failed with the custom ops' output types filled in: {exc}",
            checker_message=str(exc)) from exc


class CustomOpShapes(Pass):
    """Infer the outputs of custom-op nodes with their shape functions (see the module)."""

    name = "custom_op_shapes"
    stage = JobStage.CHECKING

    def __init__(self, registry: OpRegistry | None = None) -> None:
        self.registry = registry if registry is not None else OpRegistry()

    def run(self, model: onnx.ModelProto) -> onnx.ModelProto:
        pending = [i for i, node in enumerate(model.graph.node) if _is_custom(node)]
        if not pending:
            return model
        for _ in range(len(pending) + 1):
            model = _infer(model)
            types = _known_types(model.graph)
            progressed = []
            for index in pending:
                node = model.graph.node[index]
                if any(name and name not in types for name in node.input):
                    continue  # an input is still untyped: later
                inputs = [types[name] if name else None for name in node.input]
                _check_inputs(node, self.registry, inputs)
                definition = self.registry.get(qualified_op(node.domain, node.op_type))
                progressed.append(index)
                if definition.shape_function is None:
                    logger.warning("%s has no shape function; its outputs stay untyped",
                                   _describe(node))
                    continue
                try:
                    attributes = resolve_attributes(definition.spec, node_attributes(node))
                except InvalidRequest as exc:
                    raise ModelCheckFailed(f"{_describe(node)}: {exc.message}",
                                           node=node.name) from exc
                outputs = definition.infer(inputs, attributes)
                for name, inferred in zip(node.output, outputs, strict=False):
                    if name:
                        _set_type(model.graph, name, inferred, node)
                logger.debug("%s: %s -> %s", _describe(node), [str(t) for t in inputs],
                             [str(t) for t in outputs])
            pending = [i for i in pending if i not in progressed]
            if not pending or not progressed:
                break
        if pending:
            logger.warning("the inputs of %s stay untyped; their outputs are not inferred",
                           [_describe(model.graph.node[i]) for i in pending])
        return _infer(model)


"""Generated inputs that fit the graph: the range of each integer input, read from the model.

Random token ids in ``[0, 8)`` miss most of a vocabulary, and a table of four rows fails on
index 6. So before verifying or benchmarking on generated inputs, Kiln follows each integer
graph input forward through operators that keep its values (``Cast`` to an integer type,
``Identity``, ``Reshape``, ``Flatten``, ``Squeeze``/``Unsqueeze``, ``Expand``, ``Transpose``,
``Slice``, ``Tile``, ``Concat``, ``Split``, and the data side of ``Gather``) and reads what it
finally indexes:

- the indices of ``Gather`` / ``GatherElements``: ``[0, data.shape[axis])``;
- the indices of ``GatherND``: ``[0, min(data.shape[batch_dims:batch_dims + k]))`` where ``k``
  is the indices' last dimension;
- the indices of ``OneHot``: ``[0, depth)``.

Several uses take the tightest. The data tensor's size comes from an initializer, a
``Constant``, or a static shape (declared, or inferred by ONNX shape inference). An integer
input that indexes nothing but is a mask gets ``[0, 2)``: one that is cast to ``bool`` on the
way (``attention_mask`` in models exported by ``torch.onnx.export``), or, failing any graph
evidence, one whose name contains ``mask``. Every other integer input keeps the default
``[0, INT_HIGH)`` of ``runtime_agent.samples``. Each range carries the reason it was chosen, so
a manifest can say how its inputs were generated.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterator, Mapping

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from runtime_agent.samples import IntegerRange, describe_inputs
from schemas.errors import InvalidModel
from schemas.manifest import TensorSpec

logger = logging.getLogger(__name__)

#: Operators whose output holds (some of) the values of the given input positions unchanged.
#: ``None`` means every input.
_VALUE_KEEPING: dict[str, tuple[int, ...] | None] = {
    "Identity": (0,),
    "Reshape": (0,),
    "Flatten": (0,),
    "Squeeze": (0,),
    "Unsqueeze": (0,),
    "Expand": (0,),
    "Transpose": (0,),
    "Slice": (0,),
    "Tile": (0,),
    "Concat": None,
    "Split": (0,),
    "Gather": (0,),
    "GatherElements": (0,),
    "GatherND": (0,),
}

_INTEGER_TYPES = {
    TensorProto.INT8, TensorProto.INT16, TensorProto.INT32, TensorProto.INT64,
    TensorProto.UINT8, TensorProto.UINT16, TensorProto.UINT32, TensorProto.UINT64,
}

_MASK_RANGE = (0, 2)


def input_ranges(model: onnx.ModelProto) -> dict[str, IntegerRange]:
    """The range to draw each integer input of ``model`` from, where the graph says one.

    Inputs it omits keep the default range. Raises ``InvalidModel`` for an input that indexes
    an axis of size 0 (no index is valid there).
    """
    graph = model.graph
    initializers = {init.name for init in graph.initializer}
    consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = defaultdict(list)
    for node in graph.node:
        for position, name in enumerate(node.input):
            if name:
                consumers[name].append((node, position))
    shapes = _StaticShapes(model)
    ranges: dict[str, IntegerRange] = {}
    for value in graph.input:
        if value.name in initializers:
            continue
        elem_type = value.type.tensor_type.elem_type
        if elem_type not in _INTEGER_TYPES:
            continue
        bounds: list[tuple[int, str]] = []
        cast_to_bool = False
        for node, position in _uses(value.name, consumers):
            found = _index_bound(node, position, shapes)
            if found is not None:
                bounds.append(found)
            elif node.op_type == "Cast" and _attr(node, "to") == TensorProto.BOOL:
                cast_to_bool = True
        if bounds:
            size, reason = min(bounds)
            if size <= 0:
                raise InvalidModel(
                    f"input {value.name!r} indexes an empty axis ({reason}): no index is "
                    f"valid there, so no input can be generated for it"
                )
            high = min(size, int(np.iinfo(onnx.helper.tensor_dtype_to_np_dtype(elem_type)).max)
                       + 1)
            ranges[value.name] = IntegerRange(0, high, reason)
        elif cast_to_bool:
            ranges[value.name] = IntegerRange(*_MASK_RANGE, "mask: cast to bool in the graph")
        elif "mask" in value.name.lower():
            ranges[value.name] = IntegerRange(*_MASK_RANGE, "mask: named like one")
    for name, bounds in ranges.items():
        logger.info("generated input %s: [%d, %d) (%s)", name, bounds.low, bounds.high,
                    bounds.reason)
    return ranges


def describe_generation(model: onnx.ModelProto, specs: list[TensorSpec]) -> dict[str, str]:
    """How generated feeds for ``specs`` (the inputs of ``model``) are drawn, per input:
    e.g. ``{"input_ids": "int64 in [0, 30522) (Gather on embeddings.word_embeddings.weight
    axis 0)", "pixel_values": "float32 standard normal"}``."""
    return describe_inputs(specs, input_ranges(model))


def generated_inputs_source(descriptions: Mapping[str, str]) -> str:
    """One line for a manifest's ``inputs_source``: ``generated: name: rule; ...``."""
    return "generated: " + "; ".join(f"{name}: {rule}" for name, rule in descriptions.items())


def _uses(name: str, consumers: Mapping[str, list[tuple[onnx.NodeProto, int]]]
          ) -> Iterator[tuple[onnx.NodeProto, int]]:
    """Every (node, input position) that reads ``name``'s values, unchanged or through
    value-keeping operators."""
    seen: set[str] = set()
    pending = [name]
    while pending:
        tensor = pending.pop()
        if tensor in seen:
            continue
        seen.add(tensor)
        for node, position in consumers.get(tensor, ()):
            yield node, position
            keeps = _VALUE_KEEPING.get(node.op_type, ())
            if node.op_type == "Cast" and _attr(node, "to") in _INTEGER_TYPES:
                keeps = (0,)
            if keeps is None or position in keeps:
                pending.extend(out for out in node.output if out)


def _index_bound(node: onnx.NodeProto, position: int, shapes: _StaticShapes
                 ) -> tuple[int, str] | None:
    """(exclusive upper bound, reason) when ``node`` uses its input ``position`` as indices
    into an axis of known size."""
    op = node.op_type
    if op in ("Gather", "GatherElements") and position == 1:
        shape = shapes.get(node.input[0])
        if shape is None:
            return None
        axis = int(_attr(node, "axis", 0))
        axis = axis + len(shape) if axis < 0 else axis
        if not 0 <= axis < len(shape) or shape[axis] is None:
            return None
        return shape[axis], f"{op} on {node.input[0]} axis {axis}"
    if op == "GatherND" and position == 1:
        data, indices = shapes.get(node.input[0]), shapes.get(node.input[1])
        if data is None or not indices or indices[-1] is None:
            return None
        batch = int(_attr(node, "batch_dims", 0))
        axes = data[batch:batch + indices[-1]]
        if not axes or any(d is None for d in axes):
            return None
        return min(axes), f"GatherND on {node.input[0]} axes {batch}..{batch + len(axes) - 1}"
    if op == "OneHot" and position == 0:
        depth = shapes.constant(node.input[1])
        if depth is None or depth.size != 1:
            return None
        return int(depth.reshape(-1)[0]), f"OneHot depth {int(depth.reshape(-1)[0])}"
    return None


def _attr(node: onnx.NodeProto, name: str, default: object = None) -> object:
    for attribute in node.attribute:
        if attribute.name == name:
            return onnx.helper.get_attribute_value(attribute)
    return default


class _StaticShapes:
    """Static shapes and small constant values of a graph's tensors, computed on demand."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.initializers = {init.name: init for init in model.graph.initializer}
        self.constants = {node.output[0]: node for node in model.graph.node
                          if node.op_type == "Constant" and node.output}
        self.declared = _value_shapes(model.graph)
        self._inferred: dict[str, list[int | None]] | None = None

    def get(self, name: str) -> list[int | None] | None:
        if name in self.initializers:
            return [int(d) for d in self.initializers[name].dims]
        value = self.constant(name)
        if value is not None:
            return list(value.shape)
        if name in self.declared:
            return self.declared[name]
        return self.inferred().get(name)

    def constant(self, name: str) -> np.ndarray | None:
        if name in self.initializers:
            return numpy_helper.to_array(self.initializers[name])
        node = self.constants.get(name)
        if node is None:
            return None
        for attribute in node.attribute:
            if attribute.name == "value":
                return numpy_helper.to_array(attribute.t)
            if attribute.name in ("value_int", "value_float"):
                return np.array(onnx.helper.get_attribute_value(attribute))
            if attribute.name in ("value_ints", "value_floats"):
                return np.array(onnx.helper.get_attribute_value(attribute))
        return None

    def inferred(self) -> dict[str, list[int | None]]:
        """Shapes from ONNX shape inference on a copy whose large weights keep only their
        dimensions (inference reads small constants, never large ones)."""
        if self._inferred is None:
            light = onnx.ModelProto()
            light.CopyFrom(self.model)
            for init in light.graph.initializer:
                if int(np.prod(init.dims, dtype=np.int64)) > 1024:
                    for field in ("raw_data", "float_data", "int32_data", "int64_data",
                                  "double_data", "uint64_data", "string_data"):
                        init.ClearField(field)
                    init.ClearField("external_data")
                    init.data_location = TensorProto.DEFAULT
            try:
                inferred = onnx.shape_inference.infer_shapes(light, strict_mode=False)
                self._inferred = _value_shapes(inferred.graph)
            except Exception as exc:  # onnx raises untyped errors on graphs it cannot follow
                logger.info("shape inference failed (%s); index ranges use declared shapes",
                            exc)
                self._inferred = {}
        return self._inferred


def _value_shapes(graph: onnx.GraphProto) -> dict[str, list[int | None]]:
    shapes: dict[str, list[int | None]] = {}
    for value in [*graph.input, *graph.value_info, *graph.output]:
        tensor = value.type.tensor_type
        if not tensor.HasField("shape"):
            continue
        shapes[value.name] = [d.dim_value if d.HasField("dim_value") else None
                              for d in tensor.shape.dim]
    return shapes

"""Parsing submitted ONNX bytes, and the input/output signature Kiln reports for a model.

One definition, shared by the API (which inspects uploads) and the compiler (which records an
engine's signature). Pure translation of bytes already in memory; ``onnx`` is imported lazily
so ``schemas`` stays importable without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from schemas.errors import InvalidModel
from schemas.manifest import TensorSpec

if TYPE_CHECKING:
    import onnx

#: Shape of a tensor whose rank is unknown.
UNKNOWN_RANK = ["..."]
#: A dimension with neither a value nor a name.
UNKNOWN_DIM = "?"


def load_model_bytes(data: bytes) -> onnx.ModelProto:
    import onnx
    from google.protobuf.message import DecodeError

    """Parse ONNX bytes into a ``ModelProto``.

    Raises ``InvalidModel`` for empty bytes, bytes that are not an ONNX protobuf (corrupt or
    truncated), a model without a graph, and tensors stored as external data (a single-file
    upload cannot carry them).
    """

    if not data:
        raise InvalidModel("the model is empty (0 bytes); expected a serialized ONNX ModelProto")
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise InvalidModel(
            f"the {len(data)} bytes are not a serialized ONNX ModelProto (corrupt or "
            f"truncated): {exc}",
            size=len(data),
        ) from exc
    if not model.HasField("graph") or not model.graph.node or not model.graph.output:
        raise InvalidModel(
            f"the {len(data)} bytes parse as protobuf but hold no ONNX graph with nodes and "
            f"outputs; expected a serialized ONNX ModelProto",
            size=len(data),
        )
    external = [t.name for t in _all_initializers(model.graph)
                if t.data_location == onnx.TensorProto.EXTERNAL]
    if external:
        raise InvalidModel(
            f"the model keeps {len(external)} tensor(s) in external data files (e.g. "
            f"{external[:3]}); upload a self-contained model",
            external_tensors=external[:20],
        )
    return model


def _all_initializers(graph: onnx.GraphProto):
    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            if attribute.HasField("g"):
                yield from _all_initializers(attribute.g)
            for subgraph in attribute.graphs:
                yield from _all_initializers(subgraph)


def default_opset(model: onnx.ModelProto) -> int:
    """The version of the default (``ai.onnx``) domain the model imports."""
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            return opset.version
    raise InvalidModel("the model imports no default-domain (ai.onnx) opset")


def _spec(value: onnx.ValueInfoProto) -> TensorSpec:
    if not value.type.HasField("tensor_type"):
        kind = value.type.WhichOneof("value") or "unknown"
        raise InvalidModel(
            f"{value.name!r} is a {kind}; Kiln compiles models whose inputs and outputs are "
            f"tensors"
        )
    from onnx import helper

    tensor = value.type.tensor_type
    try:
        dtype = helper.tensor_dtype_to_np_dtype(tensor.elem_type).name
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidModel(
            f"{value.name!r} has element type {tensor.elem_type}, which has no numpy dtype"
        ) from exc
    if not tensor.HasField("shape"):
        return TensorSpec(name=value.name, dtype=dtype, shape=list(UNKNOWN_RANK))
    shape: list[int | str] = []
    for dim in tensor.shape.dim:
        if dim.HasField("dim_value"):
            shape.append(dim.dim_value)
        elif dim.HasField("dim_param") and dim.dim_param:
            shape.append(dim.dim_param)
        else:
            shape.append(UNKNOWN_DIM)
    return TensorSpec(name=value.name, dtype=dtype, shape=shape)


def signature(model: onnx.ModelProto) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """(inputs, outputs) of the model's graph.

    Only real inputs are listed: graph inputs that are also initializers (IR < 4 style, or
    overridable initializers) are weights. A dtype is a numpy name (``"float32"``); a dimension
    is an int, its ``dim_param`` (``"N"``), or ``"?"`` when unnamed; a tensor of unknown rank
    has shape ``["..."]``.
    """
    weights = {init.name for init in model.graph.initializer}
    weights |= {sparse.values.name for sparse in model.graph.sparse_initializer}
    inputs = [_spec(v) for v in model.graph.input if v.name not in weights]
    outputs = [_spec(v) for v in model.graph.output]
    return inputs, outputs


#: Domains whose operators onnxruntime provides itself.
BUILTIN_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml", "com.microsoft"})


def custom_ops(model: onnx.ModelProto) -> set[str]:
    """``domain::OpType`` of every node outside the built-in domains, subgraphs included."""
    from schemas.plugins import qualified_op

    found: set[str] = set()

    def walk(graph) -> None:
        for node in graph.node:
            if node.domain not in BUILTIN_DOMAINS:
                found.add(qualified_op(node.domain, node.op_type))
            for attribute in node.attribute:
                if attribute.HasField("g"):
                    walk(attribute.g)
                for subgraph in attribute.graphs:
                    walk(subgraph)

    walk(model.graph)
    return found

"""The op registry, tensor types and attribute resolution."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime_agent.plugins import (
    DuplicateOp,
    NativeLibrary,
    NoImplementation,
    OpDefinition,
    OpRegistry,
    PythonKernel,
    ShapeFunctionError,
    TensorType,
    UnknownOp,
    resolve_attributes,
    split_op,
)
from schemas.errors import ErrorCode, InvalidRequest
from schemas.plugins import AttributeSpec, OpSpec, TensorArg


def spec(op_type: str = "Swish", domain: str = "kiln.test", **extra) -> OpSpec:
    return OpSpec(domain=domain, op_type=op_type,
                  inputs=[TensorArg(name="x", dtypes=["float32"])],
                  outputs=[TensorArg(name="y", dtypes=["float32"])], **extra)


def kernel(ctx, inputs, outputs, attributes):  # pragma: no cover - never run here
    pass


def test_register_get_and_unknown_lists_registered_ops() -> None:
    registry = OpRegistry()
    definition = registry.register(spec(), lambda i, a: i, source="test 1.0")
    assert registry.get("kiln.test::Swish") is definition
    assert "kiln.test::Swish" in registry and len(registry) == 1
    assert registry.domains() == ["kiln.test"]
    with pytest.raises(UnknownOp, match=r"Could not find a registered custom op: "
                                        r"'kiln.test::Gelu'. Currently registered ops are: "
                                        r"\['kiln.test::Swish'\]") as info:
        registry.get("kiln.test::Gelu")
    assert info.value.code is ErrorCode.UNKNOWN_OPERATOR
    with pytest.raises(UnknownOp, match="none"):
        OpRegistry().get("a::B")


def test_duplicates_raise_and_never_keep_the_first_silently() -> None:
    registry = OpRegistry()
    registry.register(spec(), source="plugin-a 1.0")
    with pytest.raises(DuplicateOp, match=r"kiln.test::Swish is already registered \(from "
                                          r"plugin-a 1.0\); refusing .* plugin-b 2.0"):
        registry.register(spec(), source="plugin-b 2.0")
    registry.register_kernel(PythonKernel("kiln.test::Swish", "onnxruntime", "cpu", kernel,
                                          "swish:kernel"))
    with pytest.raises(DuplicateOp, match=r"already has a kernel for onnxruntime/cpu"):
        registry.register_kernel(PythonKernel("kiln.test::Swish", "onnxruntime", "cpu", kernel,
                                              "other:kernel"))
    other = OpRegistry()
    other.register(spec(), source="plugin-c 1.0")
    with pytest.raises(DuplicateOp, match=r"plugin-c 1\.0"):
        OpRegistry.union([registry, other])


def test_kernels_are_kept_apart_from_the_definition_per_backend_and_device() -> None:
    registry = OpRegistry()
    registry.register(spec(), source="p 1")
    registry.register(spec("Inverse"), source="p 1")
    python = PythonKernel("kiln.test::Swish", "onnxruntime", "cpu", kernel, "swish:kernel")
    native = NativeLibrary(("kiln.test::Swish", "kiln.test::Inverse"), "onnxruntime", "cuda",
                           Path("/lib/x.so"), "linux-x86_64/ort-api-17", "lib/x.so")
    registry.register_kernel(python)
    registry.register_kernel(native)
    assert registry.kernel("kiln.test::Swish", "onnxruntime", "cpu") is python
    assert registry.kernel("kiln.test::Inverse", "onnxruntime", "cuda") is native
    assert registry.get("kiln.test::Swish").targets() == ["onnxruntime/cpu", "onnxruntime/cuda"]
    with pytest.raises(NoImplementation, match=r"op kiln.test::Inverse has no implementation for "
                                               r"backend 'onnxruntime' on device 'cpu'; it has "
                                               r"implementations for \['onnxruntime/cuda'\]"):
        registry.kernel("kiln.test::Inverse", "onnxruntime", "cpu")


def test_split_op() -> None:
    assert split_op("ai.onnx.contrib::Inverse") == ("ai.onnx.contrib", "Inverse")
    with pytest.raises(UnknownOp, match="domain::OpType"):
        split_op("Inverse")


def test_infer_checks_what_the_shape_function_returns() -> None:
    ok = OpDefinition(spec(), lambda inputs, attributes: [inputs[0]])
    assert ok.infer([TensorType("float32", ("N", 3))], {}) == [TensorType("float32", ("N", 3))]
    raising = OpDefinition(spec(), lambda i, a: 1 / 0, source="p 1")
    with pytest.raises(ShapeFunctionError, match=r"the shape function of op kiln.test::Swish "
                                                 r"\(p 1\) raised ZeroDivisionError: division "
                                                 r"by zero") as info:
        raising.infer([TensorType("float32", (2,))], {})
    assert info.value.code is ErrorCode.PLUGIN_ERROR
    wrong_count = OpDefinition(spec(), lambda i, a: [])
    with pytest.raises(ShapeFunctionError, match=r"expected 1 TensorType"):
        wrong_count.infer([TensorType("float32", (2,))], {})
    wrong_dtype = OpDefinition(spec(), lambda i, a: [TensorType("int64", (2,))])
    with pytest.raises(ShapeFunctionError, match=r"dtype int64; the op declares \['float32'\]"):
        wrong_dtype.infer([TensorType("float32", (2,))], {})
    with pytest.raises(ShapeFunctionError, match="has no shape function"):
        OpDefinition(spec()).infer([TensorType("float32", (2,))], {})


def test_tensor_type_normalizes_and_validates() -> None:
    t = TensorType("float32", ["N", 3, None])
    assert t.shape == ("N", 3, None) and t.rank == 3 and not t.concrete
    assert str(t) == "float32[N, 3, None]"
    assert TensorType("object").dtype == "string" and TensorType("float32").rank is None
    assert TensorType("float32", (2, 3)).concrete
    with pytest.raises(InvalidRequest, match="non-negative int"):
        TensorType("float32", (-1,))
    with pytest.raises(InvalidRequest, match="not a numpy dtype"):
        TensorType("floaty")


def test_attributes_get_defaults_types_and_clear_errors() -> None:
    op = spec(attributes=[
        AttributeSpec(name="beta", type="float", default=1.0),
        AttributeSpec(name="axis", type="int", required=True),
        AttributeSpec(name="mode", type="string", default="fast"),
        AttributeSpec(name="pads", type="ints", default=[0, 0]),
        AttributeSpec(name="scales", type="floats"),
    ])
    assert resolve_attributes(op, {"axis": 1}) == {"beta": 1.0, "axis": 1, "mode": "fast",
                                                   "pads": [0, 0]}
    assert resolve_attributes(op, {"axis": 1, "beta": 2, "mode": b"slow", "scales": [1, 2]}) == {
        "beta": 2.0, "axis": 1, "mode": "slow", "pads": [0, 0], "scales": [1.0, 2.0]}
    with pytest.raises(InvalidRequest, match=r"requires attribute 'axis' \(int\)"):
        resolve_attributes(op, {})
    with pytest.raises(InvalidRequest, match=r"has no attribute\(s\) \['gamma'\]; it declares"):
        resolve_attributes(op, {"axis": 1, "gamma": 1.0})
    with pytest.raises(InvalidRequest, match=r"attribute 'axis' of op kiln.test::Swish is int; "
                                             r"got 1.5"):
        resolve_attributes(op, {"axis": 1.5})

"""Helpers for the compiler tests: fast options and small models built in code.

(General-purpose golden models live in ``kiln.examples``; these exist to provoke failures.)
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from schemas.options import CompileOptions


def fast_options(**overrides: object) -> CompileOptions:
    """Options with few verification samples and benchmark iterations, untuned (the backend's
    default candidate alone): for tests of what a build does, not of what tuning chooses."""
    values: dict[str, object] = {"verify_samples": 2, "benchmark_iterations": 3, "tune": "off"}
    values.update(overrides)
    return CompileOptions(**values)


def ill_conditioned_layernorm(*, offset: float = 1e6, features: int = 64) -> onnx.ModelProto:
    """LayerNorm written out as ONNX primitives, applied to ``x + offset``.

    onnxruntime's extended level fuses the pattern into its LayerNormalization kernel, which
    accumulates mean and variance differently from the ReduceMean/Sub/Pow chain. With inputs a
    million away from zero, float32 cancellation makes the two disagree by far more than the
    default tolerance: an honest verification failure, no mocking involved.
    """
    nodes = [
        helper.make_node("Add", ["x", "offset"], ["shifted"]),
        helper.make_node("ReduceMean", ["shifted"], ["mean"], axes=[-1]),
        helper.make_node("Sub", ["shifted", "mean"], ["centered"]),
        helper.make_node("Pow", ["centered", "two"], ["squared"]),
        helper.make_node("ReduceMean", ["squared"], ["variance"], axes=[-1]),
        helper.make_node("Add", ["variance", "epsilon"], ["variance_eps"]),
        helper.make_node("Sqrt", ["variance_eps"], ["std"]),
        helper.make_node("Div", ["centered", "std"], ["normalized"]),
        helper.make_node("Mul", ["normalized", "gamma"], ["scaled"]),
        helper.make_node("Add", ["scaled", "beta"], ["y"]),
    ]
    initializers = [
        numpy_helper.from_array(np.array(offset, np.float32), "offset"),
        numpy_helper.from_array(np.array(2.0, np.float32), "two"),
        numpy_helper.from_array(np.array(1e-5, np.float32), "epsilon"),
        numpy_helper.from_array(np.ones(features, np.float32), "gamma"),
        numpy_helper.from_array(np.zeros(features, np.float32), "beta"),
    ]
    graph = helper.make_graph(
        nodes,
        "ill_conditioned_layernorm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", features])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", features])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def ill_typed_model() -> onnx.ModelProto:
    """Adds a float tensor to an int64 one: the checker's type inference rejects it."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["c"])],
        "ill_typed",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2]),
         helper.make_tensor_value_info("b", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def sequence_model(*, dims: list[int | str]) -> onnx.ModelProto:
    """``y = relu(x)`` with ``x`` of the given dims (dynamic ones as strings)."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model

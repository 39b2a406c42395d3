"""Models that use the example plugins' ops, built in code with seeded weights.

- ``swish_cnn()``: a small CNN on 3×32×32 images whose activations are ``kiln.examples::Swish``
  (one with ``beta=1.5``, one left to the attribute's default); ``builtin=True`` writes the same
  network with ``x * Sigmoid(beta * x)`` in built-in ops instead.
- ``swish_model(shape)``: one Swish (or its built-in equivalent) on a tensor of ``shape``,
  for measuring dispatch overhead.
- ``inverse_model(n)``: ``2 * Inverse(a + n·I)`` on an ``n×n`` matrix with
  ``ai.onnx.contrib::Inverse`` from onnxruntime-extensions' native library.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

SWISH_DOMAIN = "kiln.examples"
CONTRIB_DOMAIN = "ai.onnx.contrib"


def _init(name: str, array: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(array, dtype=np.float32), name)


def _swish(x: str, y: str, beta: float | None, builtin: bool, tag: str) -> tuple[list, list]:
    """Nodes (and initializers) computing ``y = x * sigmoid(beta * x)``."""
    if not builtin:
        attrs = {} if beta is None else {"beta": beta}
        return [helper.make_node("Swish", [x], [y], domain=SWISH_DOMAIN, **attrs)], []
    b = 1.0 if beta is None else beta
    return [
        helper.make_node("Mul", [x, f"{tag}_beta"], [f"{tag}_bx"]),
        helper.make_node("Sigmoid", [f"{tag}_bx"], [f"{tag}_sig"]),
        helper.make_node("Mul", [x, f"{tag}_sig"], [y]),
    ], [_init(f"{tag}_beta", np.array(b))]


def _model(graph: onnx.GraphProto, domains: dict[str, int], opset: int = 17) -> onnx.ModelProto:
    model = helper.make_model(
        graph, producer_name="kiln.examples.plugins",
        opset_imports=[helper.make_opsetid("", opset)]
        + [helper.make_opsetid(d, v) for d, v in domains.items()],
    )
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def swish_cnn(*, batch: int | str = "N", seed: int = 0, builtin: bool = False) -> onnx.ModelProto:
    """Conv-BN-Swish(β=1.5) → Conv(stride 2)-Swish(default β) → global pool → Gemm → Softmax."""
    rng = np.random.default_rng(seed)
    inits = [
        _init("w1", rng.normal(0, 0.2, (16, 3, 3, 3))),
        _init("b1", rng.normal(0, 0.1, (16,))),
        _init("bn_scale", rng.uniform(0.5, 1.5, (16,))),
        _init("bn_bias", rng.normal(0, 0.1, (16,))),
        _init("bn_mean", rng.normal(0, 0.1, (16,))),
        _init("bn_var", rng.uniform(0.5, 1.5, (16,))),
        _init("w2", rng.normal(0, 0.1, (32, 16, 3, 3))),
        _init("b2", rng.normal(0, 0.1, (32,))),
        _init("fc_w", rng.normal(0, 0.1, (32, 10))),
        _init("fc_b", rng.normal(0, 0.1, (10,))),
    ]
    act1, extra1 = _swish("n1", "a1", 1.5, builtin, "act1")
    act2, extra2 = _swish("c2", "a2", None, builtin, "act2")
    nodes = [
        helper.make_node("Conv", ["image", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization",
                         ["c1", "bn_scale", "bn_bias", "bn_mean", "bn_var"], ["n1"]),
        *act1,
        helper.make_node("Conv", ["a1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2]),
        *act2,
        helper.make_node("GlobalAveragePool", ["a2"], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["flat"], axis=1),
        helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes, "kiln_swish_cnn",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, [batch, 3, 32, 32])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [batch, 10])],
        initializer=inits + extra1 + extra2,
    )
    return _model(graph, {} if builtin else {SWISH_DOMAIN: 1})


def swish_model(shape: list[int | str], *, beta: float = 1.0,
                builtin: bool = False) -> onnx.ModelProto:
    """``y = Swish(x)`` for ``x`` of ``shape``, as the custom op or in built-in ops."""
    nodes, inits = _swish("x", "y", beta, builtin, "swish")
    graph = helper.make_graph(
        nodes, "kiln_swish",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        initializer=inits,
    )
    return _model(graph, {} if builtin else {SWISH_DOMAIN: 1})


def inverse_model(n: int = 4) -> onnx.ModelProto:
    """``2 * Inverse(a + n·I)`` (the shift keeps the matrix well conditioned) on ``a: n×n``."""
    nodes = [
        helper.make_node("Add", ["a", "shift"], ["conditioned"]),
        helper.make_node("Inverse", ["conditioned"], ["inv"], domain=CONTRIB_DOMAIN),
        helper.make_node("Mul", ["inv", "two"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "kiln_inverse",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [n, n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n, n])],
        initializer=[_init("shift", n * np.eye(n)), _init("two", np.array(2.0))],
    )
    return _model(graph, {CONTRIB_DOMAIN: 1})

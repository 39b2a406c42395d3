"""Small models built in code, for the demo, the tests and the benchmarks.

Each builder returns a valid, self-contained ONNX ``ModelProto`` with seeded random weights.
"""

from __future__ import annotations

import numpy as np


def _init(name: str, array: np.ndarray):
    from onnx import numpy_helper

    return numpy_helper.from_array(array.astype(np.float32), name)


def small_cnn(*, batch: int | str = "N", seed: int = 0, opset: int = 17):
    """Conv-BN-ReLU ×2 → global pool → Gemm → Softmax on 3×32×32 images (dynamic batch)."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(seed)
    inits = [
        _init("w1", rng.normal(0, 0.2, (16, 3, 3, 3))),
        _init("b1", rng.normal(0, 0.1, (16,))),
        _init("bn1_scale", rng.uniform(0.5, 1.5, (16,))),
        _init("bn1_bias", rng.normal(0, 0.1, (16,))),
        _init("bn1_mean", rng.normal(0, 0.1, (16,))),
        _init("bn1_var", rng.uniform(0.5, 1.5, (16,))),
        _init("w2", rng.normal(0, 0.1, (32, 16, 3, 3))),
        _init("b2", rng.normal(0, 0.1, (32,))),
        _init("fc_w", rng.normal(0, 0.1, (32, 10))),
        _init("fc_b", rng.normal(0, 0.1, (10,))),
    ]
    nodes = [
        helper.make_node("Conv", ["image", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node(
            "BatchNormalization",
            ["c1", "bn1_scale", "bn1_bias", "bn1_mean", "bn1_var"],
            ["n1"],
        ),
        helper.make_node("Relu", ["n1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("GlobalAveragePool", ["r2"], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["flat"], axis=1),
        helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "kiln_small_cnn",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, [batch, 3, 32, 32])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [batch, 10])],
        initializer=inits,
    )
    return _finish(graph, opset)


def mlp(*, in_features: int = 64, hidden: int = 256, out_features: int = 16,
        batch: int | str = "N", seed: int = 0, opset: int = 17):
    """Two Gemm layers with a ReLU between them."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(seed)
    inits = [
        _init("w1", rng.normal(0, 0.1, (in_features, hidden))),
        _init("b1", rng.normal(0, 0.1, (hidden,))),
        _init("w2", rng.normal(0, 0.1, (hidden, out_features))),
        _init("b2", rng.normal(0, 0.1, (out_features,))),
    ]
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"]),
        helper.make_node("Relu", ["h"], ["hr"]),
        helper.make_node("Gemm", ["hr", "w2", "b2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "kiln_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, in_features])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, out_features])],
        initializer=inits,
    )
    return _finish(graph, opset)


def onnx_test_model(name: str):
    """A model shipped inside the ``onnx`` package's backend test data (e.g. light_resnet50)."""
    from pathlib import Path

    import onnx

    path = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light" / f"{name}.onnx"
    if not path.exists():
        available = sorted(p.stem for p in path.parent.glob("*.onnx"))
        raise FileNotFoundError(f"no shipped model {name!r}; available: {available}")
    return onnx.load(path)


def _finish(graph, opset: int):
    import onnx
    from onnx import helper

    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="kiln.examples"
    )
    model.ir_version = min(model.ir_version, 8)
    onnx.checker.check_model(model, full_check=True)
    return model

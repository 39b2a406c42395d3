"""The run side's reference runtime, found by model format (``reference_for``): what
``kiln demo`` checks a served answer against, with no module outside the technology's folder
naming the runtime."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.examples import mlp
from runtime_agent.executors import reference_for
from schemas.errors import BackendUnavailable


def test_the_onnx_reference_runs_the_model_as_submitted() -> None:
    model = mlp()
    weights = {init.name: init for init in model.graph.initializer}
    x = np.random.default_rng(0).standard_normal(
        [d.dim_value or 1 for d in model.graph.input[0].type.tensor_type.shape.dim]
    ).astype(np.float32)
    names = [output.name for output in model.graph.output]
    runner = reference_for("onnx").reference(model, names, "a test model")
    (out,) = runner.run({model.graph.input[0].name: x}).values()
    assert out.shape[0] == x.shape[0] and np.isfinite(out).all()
    assert "ORT_DISABLE_ALL" in runner.name and "a test model" in runner.name
    # Computed by hand from the model's own weights: the runner runs this model, unoptimized.
    from onnx import numpy_helper

    expected = x
    for node in model.graph.node:
        if node.op_type == "Gemm":
            w, b = (numpy_helper.to_array(weights[n]) for n in node.input[1:3])
            trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
            expected = expected @ (w.T if trans_b else w) + b
        elif node.op_type == "MatMul":
            expected = expected @ numpy_helper.to_array(weights[node.input[1]])
        elif node.op_type == "Add":
            expected = expected + numpy_helper.to_array(weights[node.input[1]])
        elif node.op_type == "Relu":
            expected = np.maximum(expected, 0)
        else:
            pytest.skip(f"the example model grew a {node.op_type}; extend this check")
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


def test_a_format_with_no_reference_runtime_is_a_typed_refusal() -> None:
    with pytest.raises(BackendUnavailable, match="reference for torch-export"):
        reference_for("torch-export")

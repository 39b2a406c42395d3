"""The kernel interface: tensor views (numpy and DLPack), the context, output pre-allocation,
and the user API ``kiln.ops`` (declare, test with numpy, write a plugin folder)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from kiln import ops
from runtime_agent.plugins import (
    KernelContext,
    NoImplementation,
    ScratchAllocator,
    ShapeFunctionError,
    TensorType,
    TensorView,
    invoke_kernel,
    load_plugin,
)
from schemas.errors import InvalidRequest


class DLPackOnly:
    """A tensor that only speaks DLPack (as a torch or cupy tensor would), backed by numpy."""

    def __init__(self, array: np.ndarray) -> None:
        self._array = array

    def __dlpack__(self, *args, **kwargs):
        return self._array.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


def test_views_of_numpy_arrays_have_element_strides_and_share_memory() -> None:
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    view = TensorView.from_numpy(array.T)
    assert (view.dtype, view.shape, view.strides, view.device) == (
        np.dtype(np.float32), (4, 3), (1, 4), "cpu")
    assert view.numpy().base is array.T.base and view.type == TensorType("float32", (4, 3))
    assert view.ndim == 2 and view.size == 12


def test_from_dlpack_reads_cpu_tensors_without_copying() -> None:
    array = np.arange(6, dtype=np.int64).reshape(2, 3)
    view = TensorView.from_dlpack(DLPackOnly(array))
    assert (view.dtype, view.shape, view.strides, view.device) == (
        np.dtype(np.int64), (2, 3), (3, 1), "cpu")
    array[0, 0] = 42
    assert view.numpy()[0, 0] == 42  # the same memory
    again = np.from_dlpack(view)  # a view passes on through DLPack
    assert np.shares_memory(again, array)
    with pytest.raises(InvalidRequest, match="does not support DLPack"):
        TensorView.from_dlpack([1, 2, 3])


def test_a_device_view_has_no_numpy() -> None:
    view = TensorView(dtype=np.dtype(np.float32), shape=(2,), strides=(1,), device="cuda:0")
    with pytest.raises(InvalidRequest, match=r"a tensor on cuda:0 has no numpy\(\) view"):
        view.numpy()


def test_scratch_buffers_are_reused_after_release() -> None:
    scratch = ScratchAllocator()
    first = scratch.allocate((4, 4), np.float32)
    scratch.release()
    assert scratch.allocate((4, 4), np.float32) is first
    assert scratch.allocate((4, 4), np.float32) is not first  # in use: a new one
    assert scratch.peak_bytes == 2 * 64


def swish_definition():
    from runtime_agent.plugins import OpDefinition
    from schemas.plugins import AttributeSpec, OpSpec, TensorArg

    spec = OpSpec(domain="kiln.test", op_type="Swish",
                  inputs=[TensorArg(name="x", dtypes=["float32"])],
                  outputs=[TensorArg(name="y", dtypes=["float32"])],
                  attributes=[AttributeSpec(name="beta", type="float", default=1.0)])
    return OpDefinition(spec, lambda inputs, attributes: [inputs[0]], source="test")


def test_invoke_preallocates_outputs_and_passes_the_context() -> None:
    seen = {}

    def kernel(ctx: KernelContext, inputs, outputs, attributes) -> None:
        seen.update(ctx=ctx, inputs=inputs, outputs=outputs, attributes=attributes)
        x, y = inputs[0].numpy(), outputs[0].numpy()
        t = ctx.allocate(x.shape, x.dtype)
        np.multiply(x, -attributes["beta"], out=t)
        np.divide(x, 1 + np.exp(t), out=y)
        ctx.logger.debug("ran")

    x = np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4)
    [y] = invoke_kernel(swish_definition(), kernel, [DLPackOnly(x)], {"beta": 2})
    np.testing.assert_allclose(y, x / (1 + np.exp(-2 * x)), rtol=1e-6)
    ctx = seen["ctx"]
    assert (ctx.op, ctx.device, ctx.stream) == ("kiln.test::Swish", "cpu", None)
    assert isinstance(ctx.logger, logging.Logger) and ctx.scratch.peak_bytes == x.nbytes
    assert seen["attributes"] == {"beta": 2.0}
    assert seen["outputs"][0].numpy() is y and seen["inputs"][0].shape == (3, 4)


def test_invoke_refuses_bad_inputs_and_kernels_that_return() -> None:
    definition = swish_definition()
    x = np.ones((2, 2), np.float32)
    with pytest.raises(InvalidRequest, match=r"input 'x' has dtype float64; the op takes "
                                             r"\['float32'\]"):
        invoke_kernel(definition, lambda *a: None, [x.astype(np.float64)], {})
    with pytest.raises(InvalidRequest, match=r"returned ndarray; a kernel writes into its "
                                             r"pre-allocated outputs and returns None"):
        invoke_kernel(definition, lambda ctx, i, o, a: i[0].numpy(), [x], {})
    definition.shape_function = lambda inputs, attributes: [TensorType("float32", ("N", 2))]
    with pytest.raises(ShapeFunctionError, match="for concrete inputs"):
        invoke_kernel(definition, lambda *a: None, [x], {})


# ---------------------------------------------------------------- kiln.ops

def test_kiln_ops_declares_tests_and_writes_a_plugin(tmp_path: Path) -> None:
    from tests.plugins.helpers import EXAMPLES

    module = load_module(EXAMPLES / "swish" / "swish.py")
    swish = module.swish
    assert swish.name == "kiln.examples::Swish" and swish.spec.attributes[0].default == 1.0
    x = np.array([[-2.0, 0.0, 3.0]], np.float32)
    np.testing.assert_allclose(swish(x, beta=1.5), x / (1 + np.exp(-1.5 * x)), rtol=1e-6)
    assert swish.infer(TensorType("float32", ("N", 3))) == [TensorType("float32", ("N", 3))]
    with pytest.raises(NoImplementation, match=r"has implementations for \['onnxruntime/cpu', "
                                               r"'torch/cpu', 'torch/cuda'\]"):
        swish.run([x], backend="onnxruntime", device="cuda")

    folder = ops.write_plugin(tmp_path / "swish", name="swish", version="1.0.0", ops=[swish],
                              requires=["onnxruntime-extensions>=0.12"])
    written = json.loads((folder / "plugin.json").read_text())
    committed = json.loads((EXAMPLES / "swish" / "plugin.json").read_text())
    assert written["ops"][0]["shape_function"] == "swish:swish_shape"
    assert written["implementations"] == [
        {"ops": ["kiln.examples::Swish"], "kind": "python", "entry": "swish:swish_cpu"},
        {"ops": ["kiln.examples::Swish"], "backend": "torch", "kind": "python",
         "entry": "swish:swish_torch_cpu"},
        {"ops": ["kiln.examples::Swish"], "backend": "torch", "device": "cuda",
         "kind": "python", "entry": "swish:swish_torch_cuda"}]
    for key in ("inputs", "outputs", "attributes", "shape_function"):
        assert written["ops"][0][key] == committed["ops"][0][key]
    plugin = load_plugin(folder)
    np.testing.assert_array_equal(ops.call(plugin, "kiln.examples::Swish", x, beta=1.5),
                                  swish(x, beta=1.5))


def test_kiln_ops_refuses_duplicates_and_unknown_attribute_defaults() -> None:
    op = ops.custom_op("kiln.test::Twice", inputs={"x": ["float32", "float64"]},
                       outputs={"y": ["float32", "float64"]},
                       attributes={"n": 2, "mode": "a", "pads": [1, 2]})
    assert [(a.name, a.type) for a in op.spec.attributes] == [
        ("n", "int"), ("mode", "string"), ("pads", "ints")]

    @op.register_kernel("onnxruntime", "cpu")
    def twice(ctx, inputs, outputs, attributes):
        outputs[0].numpy()[...] = inputs[0].numpy() * attributes["n"]

    with pytest.raises(ops.DuplicateOp, match="already has a kernel for onnxruntime/cpu"):
        op.register_kernel("onnxruntime", "cpu")(twice)
    with pytest.raises(ShapeFunctionError, match="has no shape function"):
        op(np.ones(2))
    op.register_shape(lambda inputs, attributes: [inputs[0]])
    with pytest.raises(ops.DuplicateOp, match="already has a shape function"):
        op.register_shape(lambda inputs, attributes: [inputs[0]])
    np.testing.assert_array_equal(op(np.ones(2), n=3), np.full(2, 3.0))
    with pytest.raises(InvalidRequest, match="give a default int, float, str"):
        ops.custom_op("kiln.test::Bad", inputs={"x": "float32"}, outputs={"y": "float32"},
                      attributes={"flag": True})


def load_module(path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

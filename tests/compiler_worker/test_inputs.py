"""Generated inputs that fit the graph: index ranges read from the model, drawn and described."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler_worker.backends.onnxruntime.reference import OnnxRuntimeReference
from compiler_worker.inputs import describe_generation, generated_inputs_source, input_ranges
from compiler_worker.modelio import signature
from compiler_worker.pipeline import compile_model
from compiler_worker.verify import random_inputs, verify
from runtime_agent.samples import INT_HIGH, IntegerRange, describe_inputs, sample_inputs
from schemas.errors import InvalidModel, InvalidRequest
from schemas.fingerprint import HardwareFingerprint
from schemas.manifest import TensorSpec
from schemas.options import CompileOptions
from tests.compiler_worker.helpers import fast_options


def _embedding_test_model() -> Path:
    """onnx's converted ``nn.Embedding(4, 3)``: input ``0`` (int64 [1, 4]) gathers from ``1``."""
    return (Path(onnx.__file__).parent / "backend" / "test" / "data" / "pytorch-converted"
            / "test_Embedding" / "model.onnx")


def _model(nodes, inputs, outputs, initializers=(), opset: int = 17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _table(name: str, *shape: int) -> onnx.TensorProto:
    return numpy_helper.from_array(np.zeros(shape, np.float32), name)


def _int_input(name: str, shape, elem_type=TensorProto.INT64):
    return helper.make_tensor_value_info(name, elem_type, shape)


def _float_output(name: str):
    """An output whose shape the analysis never needs (left undeclared)."""
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, None)


def test_the_embedding_model_verifies_on_generated_inputs_that_fit_its_table() -> None:
    model = onnx.load(_embedding_test_model())
    ranges = input_ranges(model)
    assert ranges == {"0": IntegerRange(0, 4, "Gather on 1 axis 0")}
    specs, outputs = signature(model)
    reference = OnnxRuntimeReference(model, [o.name for o in outputs], "the model")
    options = CompileOptions(verify_samples=4)
    # What failed before: the default range [0, INT_HIGH) reaches past the 4-row table.
    with pytest.raises(Exception, match=r"out of bounds|must be within"):
        for seed in range(options.verify_samples):
            reference.run(random_inputs(specs, options, seed=seed))
    result = verify(reference.run, reference.run, specs, options, ranges=ranges)
    assert result.passed and result.samples == 4


def test_the_pipeline_compiles_the_embedding_model(tmp_path: Path,
                                                   fingerprint: HardwareFingerprint) -> None:
    data = _embedding_test_model().read_bytes()
    result = compile_model(data, fast_options(verify_samples=4), fingerprint=fingerprint,
                           workdir=tmp_path / "work")
    assert result.manifest.verification.passed


def test_indices_are_followed_through_value_keeping_operators() -> None:
    shape = helper.make_tensor("shape", TensorProto.INT64, [1], [-1])
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [0])
    nodes = [
        helper.make_node("Cast", ["ids"], ["ids32"], to=TensorProto.INT32),
        helper.make_node("Unsqueeze", ["ids32", "axes"], ["u"]),
        helper.make_node("Reshape", ["u", "shape"], ["flat"]),
        helper.make_node("Gather", ["vocab", "flat"], ["emb"]),
        # the same ids also index a smaller table: the tighter range wins
        helper.make_node("Identity", ["ids"], ["same"]),
        helper.make_node("Gather", ["positions", "same"], ["pos"], axis=-1),
    ]
    model = _model(nodes, [_int_input("ids", [2, 3])],
                   [_float_output("emb"), _float_output("pos")],
                   [_table("vocab", 50, 4), _table("positions", 4, 7), shape, axes])
    assert input_ranges(model) == {"ids": IntegerRange(0, 7, "Gather on positions axis 1")}


def test_gather_elements_gather_nd_and_one_hot_bound_their_indices() -> None:
    depth = helper.make_tensor("depth", TensorProto.INT64, [], [5])
    values = helper.make_tensor("values", TensorProto.FLOAT, [2], [0.0, 1.0])
    nodes = [
        helper.make_node("GatherElements", ["data", "e"], ["ge"], axis=1),
        helper.make_node("GatherND", ["grid", "nd"], ["gnd"]),
        helper.make_node("Constant", [], ["depth_c"], value=depth),
        helper.make_node("OneHot", ["labels", "depth_c", "values"], ["onehot"]),
    ]
    model = _model(
        nodes,
        [_int_input("e", [3, 2]), _int_input("nd", [4, 2]),
         _int_input("labels", [6], TensorProto.INT32)],
        [_float_output("ge"), _float_output("gnd"), _float_output("onehot")],
        [_table("data", 3, 9), _table("grid", 6, 3, 8), values],
    )
    ranges = input_ranges(model)
    assert ranges["e"] == IntegerRange(0, 9, "GatherElements on data axis 1")
    assert ranges["nd"] == IntegerRange(0, 3, "GatherND on grid axes 0..1")
    assert ranges["labels"] == IntegerRange(0, 5, "OneHot depth 5")


def test_a_table_computed_in_the_graph_is_sized_by_shape_inference() -> None:
    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [6, 2])
    nodes = [helper.make_node("Reshape", ["weights", "shape"], ["table"]),
             helper.make_node("Gather", ["table", "ids"], ["out"])]
    model = _model(nodes, [_int_input("ids", [5])], [_float_output("out")],
                   [_table("weights", 3, 4), shape])
    assert input_ranges(model) == {"ids": IntegerRange(0, 6, "Gather on table axis 0")}


def test_masks_get_zero_or_one_and_other_integers_keep_the_default() -> None:
    nodes = [
        helper.make_node("Cast", ["keep"], ["keep_b"], to=TensorProto.BOOL),
        helper.make_node("Cast", ["keep_b"], ["keep_f"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["pad_mask"], ["pad_f"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["count"], ["count_f"], to=TensorProto.FLOAT),
        helper.make_node("Sum", ["keep_f", "pad_f", "count_f"], ["out"]),
    ]
    model = _model(nodes, [_int_input(n, [2, 3]) for n in ("keep", "pad_mask", "count")],
                   [_float_output("out")])
    ranges = input_ranges(model)
    assert ranges == {"keep": IntegerRange(0, 2, "mask: cast to bool in the graph"),
                      "pad_mask": IntegerRange(0, 2, "mask: named like one")}
    specs, _ = signature(model)
    described = describe_generation(model, specs)
    assert described["count"] == f"int64 in [0, {INT_HIGH}) (default: no table it indexes " \
                                 f"was found)"
    assert generated_inputs_source(described).startswith(
        "generated: keep: int64 in [0, 2) (mask: cast to bool in the graph); pad_mask: ")


def test_an_empty_table_is_an_invalid_model() -> None:
    model = _model([helper.make_node("Gather", ["none", "ids"], ["out"])],
                   [_int_input("ids", [2])], [_float_output("out")], [_table("none", 0, 3)])
    with pytest.raises(InvalidModel, match="input 'ids' indexes an empty axis"):
        input_ranges(model)


def test_a_small_integer_type_caps_the_range() -> None:
    model = _model([helper.make_node("Gather", ["big", "ids"], ["out"])],
                   [_int_input("ids", [2], TensorProto.INT8)], [_float_output("out")],
                   [_table("big", 300, 1)])
    assert input_ranges(model)["ids"].high == 128


SPECS = [TensorSpec(name="x", dtype="float32", shape=[2]),
         TensorSpec(name="ids", dtype="int32", shape=[1000]),
         TensorSpec(name="flags", dtype="bool", shape=[2])]


def test_sample_inputs_draw_integers_from_their_ranges() -> None:
    ranges = {"ids": IntegerRange(100, 3000, "a vocabulary")}
    feed = sample_inputs(SPECS, seed=1, ranges=ranges)
    assert feed["ids"].dtype == np.int32
    assert feed["ids"].min() >= 100 and feed["ids"].max() < 3000 and feed["ids"].max() >= INT_HIGH
    np.testing.assert_array_equal(feed["ids"], sample_inputs(SPECS, seed=1, ranges=ranges)["ids"])
    # without ranges, the same draws as before ranges existed
    assert sample_inputs(SPECS, seed=1)["ids"].max() < INT_HIGH
    assert describe_inputs(SPECS, ranges) == {
        "x": "float32 standard normal", "ids": "int32 in [100, 3000) (a vocabulary)",
        "flags": "bool fair coin flips"}


@pytest.mark.parametrize(("ranges", "message"), [
    ({"nope": IntegerRange(0, 2)}, r"given for 'nope', which is not an input; the inputs are"),
    ({"x": IntegerRange(0, 2)}, "which is a float32 tensor; ranges apply to integer inputs"),
    ({"ids": IntegerRange(3, 3)}, r"\[3, 3\) for input 'ids' is empty"),
    ({"ids": IntegerRange(0, 2**40)}, "does not fit int32"),
])
def test_sample_inputs_refuse_ranges_that_do_not_fit(ranges, message) -> None:
    with pytest.raises(InvalidRequest, match=message):
        sample_inputs(SPECS, ranges=ranges)

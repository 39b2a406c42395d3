"""Graph passes and the pass pipeline."""

from __future__ import annotations

from pathlib import Path

import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper, version_converter

from compiler_worker.modelio import default_opset, signature
from compiler_worker.passes import (
    MIN_OPSET,
    CheckModel,
    PassPipeline,
    StripInitializerInputs,
    UpgradeOpset,
    default_pipeline,
)
from kiln.examples import mlp, onnx_test_model
from schemas.errors import InvalidOptions, ModelCheckFailed, UnsupportedOpset
from tests.compiler_worker.helpers import ill_typed_model


def test_check_rejects_ill_typed_model_with_checker_message() -> None:
    with pytest.raises(ModelCheckFailed, match="ONNX checker rejected") as info:
        CheckModel().run(ill_typed_model())
    assert info.value.details["checker_message"]


def test_check_fills_output_shapes_but_keeps_inferred_value_info_out() -> None:
    model = mlp()
    output = model.graph.output[0]
    output.CopyFrom(helper.make_tensor_value_info(output.name, TensorProto.FLOAT, [None, None]))
    checked = CheckModel().run(model)
    assert not checked.graph.value_info
    out = checked.graph.output[0].type.tensor_type.shape
    assert [d.dim_value or d.dim_param for d in out.dim] == ["N", 16]


def _pytorch_converted(name: str) -> onnx.ModelProto:
    return onnx.load(Path(onnx.__file__).parent / "backend" / "test" / "data"
                     / "pytorch-converted" / name / "model.onnx")


def test_upgrade_only_below_the_minimum_and_verify_with_the_reference() -> None:
    model = _pytorch_converted("test_Conv2d")
    assert default_opset(model) == 6
    upgrade = UpgradeOpset()
    upgraded = upgrade.run(model)
    assert default_opset(upgraded) == MIN_OPSET == 7
    onnx.checker.check_model(upgraded)
    assert upgrade.detail is not None
    assert upgrade.detail.startswith("opset 6->7, outputs match onnx.reference")


def test_upgrade_leaves_opset_9_zoo_models_alone() -> None:
    model = onnx_test_model("light_resnet50")
    assert UpgradeOpset().run(model) is model


def test_upgrade_leaves_recent_models_alone() -> None:
    model = mlp(opset=17)
    assert UpgradeOpset().run(model) is model


def test_upgrade_drops_stale_value_info_of_the_old_opset() -> None:
    # Opset-9 inference types Dropout's mask as float; from opset 12 on it is bool.
    model = onnx.shape_inference.infer_shapes(onnx_test_model("light_bvlc_alexnet"),
                                              check_type=True, strict_mode=True)
    upgraded = UpgradeOpset(minimum=13, verify=False).run(model)
    assert default_opset(upgraded) == 13
    mask_names = {n.output[1] for n in upgraded.graph.node if n.op_type == "Dropout"}
    assert len(mask_names) == 2
    masks = [v for v in upgraded.graph.value_info if v.name in mask_names]
    assert all(v.type.tensor_type.elem_type == TensorProto.BOOL for v in masks)
    onnxruntime.InferenceSession(upgraded.SerializeToString(),
                                 providers=["CPUExecutionProvider"])
    onnx.shape_inference.infer_shapes(upgraded, check_type=True, strict_mode=True)


def test_upgrade_that_changes_numerics_fails_typed() -> None:
    model = _pytorch_converted("test_Conv2d")
    original_convert = version_converter.convert_version

    def sabotaged(m: onnx.ModelProto, target: int) -> onnx.ModelProto:
        converted = original_convert(m, target)
        weight = converted.graph.initializer[0]
        array = numpy_helper.to_array(weight) * 1.01
        weight.CopyFrom(numpy_helper.from_array(array, weight.name))
        return converted

    version_converter.convert_version = sabotaged
    try:
        with pytest.raises(ModelCheckFailed, match="opset 6 -> 7 conversion changes"):
            UpgradeOpset().run(model)
    finally:
        version_converter.convert_version = original_convert


def test_upgrade_failure_names_both_opsets() -> None:
    # Crop was removed from ONNX: no adapter can carry it forward.
    graph = helper.make_graph(
        [helper.make_node("Crop", ["x"], ["y"], border=[0, 0, 1, 1])],
        "crop",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 3, 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 1)])
    with pytest.raises(UnsupportedOpset, match="from opset 1 to opset 13") as info:
        UpgradeOpset(minimum=13).run(model)
    assert info.value.details == {"from_opset": 1, "to_opset": 13}


def test_strip_initializer_inputs_keeps_real_inputs_and_bumps_ir() -> None:
    model = onnx_test_model("light_resnet50")
    assert model.ir_version == 3
    before, _ = signature(model)
    stripped = StripInitializerInputs().run(model)
    assert [v.name for v in stripped.graph.input] == ["gpu_0/data_0"]
    assert stripped.ir_version == 4
    assert signature(stripped)[0] == before
    onnx.checker.check_model(stripped)


def test_pipeline_records_applied_passes_in_order() -> None:
    pipeline = default_pipeline()
    seen: list[str] = []
    pipeline.run(onnx_test_model("light_resnet50"), before_pass=lambda p: seen.append(p.name))
    assert pipeline.applied == seen == ["check", "custom_op_shapes", "upgrade_opset",
                                       "strip_initializer_inputs"]


def test_pipeline_skips_disabled_and_leaves_input_untouched() -> None:
    model = onnx_test_model("light_resnet50")
    original = model.SerializeToString()
    pipeline = default_pipeline(disabled={"upgrade_opset"})
    result = pipeline.run(model)
    assert pipeline.applied == ["check", "custom_op_shapes", "strip_initializer_inputs"]
    assert default_opset(result) == 9
    assert model.SerializeToString() == original


def test_unknown_disabled_pass_lists_the_passes() -> None:
    with pytest.raises(InvalidOptions, match=r"unknown pass\(es\) \['fuse_everything'\]; the "
                                             r"passes are \['check', 'custom_op_shapes', "
                                             r"'upgrade_opset'"):
        default_pipeline(disabled={"fuse_everything"})


def test_pass_names_must_be_unique() -> None:
    with pytest.raises(ValueError, match="unique"):
        PassPipeline([CheckModel(), CheckModel()])


def test_upgrade_keeps_opset6_prelu_slopes_per_channel() -> None:
    import numpy as np
    from onnx.reference import ReferenceEvaluator

    model = _pytorch_converted("test_PReLU_2d_multiparam")
    upgrade = UpgradeOpset()
    upgraded = upgrade.run(model)
    assert upgrade.detail is not None and "PRelu slopes" in upgrade.detail
    data = Path(onnx.__file__).parent / "backend" / "test" / "data" / "pytorch-converted" \
        / "test_PReLU_2d_multiparam" / "test_data_set_0"
    x = numpy_helper.to_array(onnx.load_tensor(str(data / "input_0.pb")))
    expected = numpy_helper.to_array(onnx.load_tensor(str(data / "output_0.pb")))
    feed = {upgraded.graph.input[0].name: x}
    got = onnxruntime.InferenceSession(upgraded.SerializeToString(),
                                       providers=["CPUExecutionProvider"]).run(None, feed)[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ReferenceEvaluator(upgraded).run(None, feed)[0], expected,
                               rtol=1e-5, atol=1e-6)


def test_check_tolerates_errors_inside_onnx_function_bodies_only() -> None:
    # MeanVarianceNormalization-13's own function body fails strict inference (ONNX's defect).
    node = helper.make_node("MeanVarianceNormalization", ["x"], ["y"])
    graph = helper.make_graph(
        [node], "mvn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 3, 3, 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 3, 3, 1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    check = CheckModel()
    assert check.run(model) is model
    assert check.detail == "ONNX function-body inference error ignored"
    # Errors of ordinary nodes are still rejected (ill-typed Add: not a function body).
    with pytest.raises(ModelCheckFailed):
        CheckModel().run(ill_typed_model())

"""Graph passes and the pass pipeline."""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper

from compiler_worker.modelio import default_opset, signature
from compiler_worker.passes import (
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


def test_check_returns_the_model_with_inferred_shapes() -> None:
    checked = CheckModel().run(mlp())
    shapes = {v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim]
              for v in checked.graph.value_info}
    assert shapes["h"] == ["N", 256]


def test_upgrade_light_resnet50_to_opset_13() -> None:
    model = onnx_test_model("light_resnet50")
    assert default_opset(model) == 9
    upgraded = UpgradeOpset().run(model)
    assert default_opset(upgraded) == 13
    assert upgraded.ir_version >= 7
    onnx.checker.check_model(upgraded)


def test_upgrade_leaves_recent_models_alone() -> None:
    model = mlp(opset=17)
    assert UpgradeOpset().run(model) is model


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
        UpgradeOpset().run(model)
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

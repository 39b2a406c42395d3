"""Loading submitted bytes and reading a model's signature."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from compiler_worker.modelio import (
    load_model,
    load_model_bytes,
    materialize_model,
    pack_model_files,
    save_model,
    signature,
)
from kiln.examples import mlp, onnx_test_model, small_cnn
from kiln.model_files import data_files_beside
from schemas.errors import InvalidModel
from tests.compiler_worker.helpers import sequence_model
from tests.models.external_data import external_cnn


def test_round_trip() -> None:
    model = load_model_bytes(small_cnn().SerializeToString())
    assert model.graph.name == "kiln_small_cnn"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "empty"),
        (b"\xff\xfe not a model at all", "not a serialized ONNX ModelProto"),
        (small_cnn().SerializeToString()[:5000], "corrupt or truncated"),
        (b"\x08\x07", "no ONNX graph"),  # a valid ModelProto with only ir_version set
    ],
)
def test_bad_bytes_are_invalid_model(data: bytes, message: str) -> None:
    with pytest.raises(InvalidModel, match=message):
        load_model_bytes(data)


def test_external_data_escaping_the_model_dir_is_refused() -> None:
    model = mlp()
    tensor = model.graph.initializer[0]
    tensor.ClearField("raw_data")
    tensor.ClearField("float_data")
    tensor.data_location = TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value="../../etc/passwd")
    with pytest.raises(InvalidModel, match=r"location '\.\./\.\./etc/passwd' is not a relative"):
        load_model_bytes(model.SerializeToString())


def test_signature_of_dynamic_batch_model() -> None:
    inputs, outputs = signature(small_cnn())
    assert [(s.name, s.dtype, s.shape) for s in inputs] == [("image", "float32", ["N", 3, 32, 32])]
    assert [(s.name, s.dtype, s.shape) for s in outputs] == [("probs", "float32", ["N", 10])]


def test_signature_lists_only_real_inputs_of_ir3_model() -> None:
    model = onnx_test_model("light_resnet50")
    assert len(model.graph.input) > 1  # its weights are listed as inputs too
    inputs, outputs = signature(model)
    assert [(s.name, s.shape) for s in inputs] == [("gpu_0/data_0", [1, 3, 224, 224])]
    assert [s.name for s in outputs] == ["gpu_0/softmax_1"]


def test_signature_unnamed_dims_and_other_dtypes() -> None:
    model = sequence_model(dims=[None, 4])  # type: ignore[list-item]
    model.graph.input[0].type.tensor_type.elem_type = TensorProto.INT64
    inputs, _ = signature(model)
    assert inputs[0].shape == ["?", 4]
    assert inputs[0].dtype == "int64"


def test_signature_refuses_non_tensor_inputs() -> None:
    graph = helper.make_graph(
        [helper.make_node("SequenceLength", ["s"], ["n"])],
        "seq",
        [helper.make_tensor_sequence_value_info("s", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("n", TensorProto.INT64, [])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(InvalidModel, match="sequence_type"):
        signature(model)


def test_loaded_model_runs_unchanged() -> None:
    import onnxruntime as ort

    data = mlp().SerializeToString()
    model = load_model_bytes(data)
    x = np.ones((2, 64), np.float32)
    a = ort.InferenceSession(data).run(None, {"x": x})[0]
    b = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_array_equal(a, b)
    assert onnx.ModelProto.FromString(data) == model


def test_external_data_not_submitted_names_the_missing_file() -> None:
    model = mlp()
    tensor = model.graph.initializer[0]
    tensor.ClearField("raw_data")
    tensor.ClearField("float_data")
    tensor.data_location = TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value="weights.bin")
    with pytest.raises(InvalidModel, match=r"\['weights.bin'\], which were not uploaded"):
        load_model_bytes(model.SerializeToString())


def test_materialize_archive_and_save_prepared_with_external_data(tmp_path: Path) -> None:
    source = external_cnn(tmp_path / "src")
    pack_model_files(source, data_files_beside(source), tmp_path / "blob")
    blob = (tmp_path / "blob").read_bytes()
    path = materialize_model(blob, tmp_path / "model")
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.onnx", "model.onnx.data"]
    model = load_model(path)
    assert all(t.data_location == TensorProto.DEFAULT for t in model.graph.initializer)
    saved = save_model(model, tmp_path / "prepared.onnx", external=True)
    assert (tmp_path / "prepared.onnx.data").stat().st_size > 10_000
    assert saved.stat().st_size < 10_000
    assert onnx.load(str(saved)).graph.initializer[0].raw_data
    plain = materialize_model(small_cnn().SerializeToString(), tmp_path / "plain")
    assert [p.name for p in plain.parent.iterdir()] == ["model.onnx"]

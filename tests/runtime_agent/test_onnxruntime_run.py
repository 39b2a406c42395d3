"""The onnxruntime executor's own ``run`` (the short path to the native run): the same answers,
the same checks and the same typed refusals as ``Executor.run``."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from runtime_agent.executors import Executor, OnnxRuntimeExecutor, load_executor
from schemas.errors import InvalidRequest
from schemas.manifest import BlobRef, TensorSpec
from tests.runtime_agent.test_executors import make_artifact


def add_artifact(directory: Path) -> OnnxRuntimeExecutor:
    """``z = a + b`` with independent dynamic dimensions: the signature takes any two vectors,
    and onnxruntime refuses two of different lengths only when it runs."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["z"])], "add",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N"]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, ["M"])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N"])])
    data = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    onnx.checker.check_model(onnx.load_from_string(data))
    manifest = make_artifact(directory)
    (directory / "engine.onnx").write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    manifest = manifest.model_copy(update={
        "model_sha256": digest,
        "blobs": [BlobRef(name="engine", sha256=digest, size=len(data),
                          media_type="application/x-onnx")],
        "inputs": [TensorSpec(name="a", dtype="float32", shape=["N"]),
                   TensorSpec(name="b", dtype="float32", shape=["M"])],
        "outputs": [TensorSpec(name="z", dtype="float32", shape=["N"])]})
    executor = load_executor(directory, manifest)
    assert isinstance(executor, OnnxRuntimeExecutor)
    return executor


def test_the_short_path_answers_as_the_general_one(tmp_path: Path) -> None:
    executor = add_artifact(tmp_path)
    a, b = np.arange(4, dtype=np.float32), np.ones(4, dtype=np.float32)
    short = executor.run({"a": a, "b": b})
    general = Executor.run(executor, {"a": a, "b": b})
    assert list(short) == ["z"] == list(general)
    np.testing.assert_array_equal(short["z"], a + b)
    np.testing.assert_array_equal(short["z"], general["z"])
    target = np.empty(4, dtype=np.float32)
    written = executor.run({"a": a, "b": b}, out={"z": target})
    assert written["z"] is target
    np.testing.assert_array_equal(target, a + b)


def test_a_feed_the_signature_refuses_is_refused_before_the_run(tmp_path: Path) -> None:
    executor = add_artifact(tmp_path)
    with pytest.raises(InvalidRequest, match="expected dtype float32"):
        executor.run({"a": np.zeros(4, dtype=np.float64), "b": np.zeros(4, dtype=np.float32)})
    with pytest.raises(InvalidRequest, match="missing"):
        executor.run({"a": np.zeros(4, dtype=np.float32)})


def test_what_onnxruntime_refuses_at_run_time_is_a_typed_refusal(tmp_path: Path) -> None:
    executor = add_artifact(tmp_path)
    with pytest.raises(InvalidRequest, match="onnxruntime could not run them") as refused:
        executor.run({"a": np.zeros(3, dtype=np.float32), "b": np.zeros(4, dtype=np.float32)})
    assert refused.value.details["artifact_id"] == executor.manifest.artifact_id

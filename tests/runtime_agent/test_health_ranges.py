"""The agent's health check feeds integer inputs inside the tables they index, as verification
did: an embedding with a 4-row table must not fail its health check on an index of 6."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from compiler_worker.pipeline import compile_model, write_artifact_dir
from runtime_agent.executors import load_executor
from runtime_agent.fingerprint import detect_fingerprint
from runtime_agent.gates import health_check
from schemas.options import CompileOptions


def embedding(rows: int = 4) -> onnx.ModelProto:
    table = helper.make_tensor("table", TensorProto.FLOAT, [rows, 3],
                               np.arange(rows * 3, dtype=np.float32).tolist())
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["y"], axis=0)], "embedding",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5, 3])], [table])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_health_check_uses_the_recorded_index_range(tmp_path: Path) -> None:
    result = compile_model(embedding().SerializeToString(), CompileOptions(tune="off"),
                           fingerprint=detect_fingerprint(), workdir=tmp_path / "work")
    [ids] = result.manifest.inputs
    assert ids.value_range == (0, 4)
    assert "[0, 4)" in result.manifest.inputs_source
    out = write_artifact_dir(result, tmp_path / "artifact")
    health_check(load_executor(out, result.manifest))  # raises HealthCheckFailed on a bad index

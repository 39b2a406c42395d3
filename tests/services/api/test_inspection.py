"""Uploads are parsed in a bounded child, never in the API process: an upload whose parse
needs more memory than ``KILN_INSPECT_MEMORY_BYTES`` is refused 413 ``resource_limit`` naming
the step, and the API goes on serving. (In the API process itself the limit would not apply
and these uploads would be stored.)"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from onnx import TensorProto, helper, numpy_helper

from services.api.app import create_app
from tests.services.api.conftest import bearer, make_settings

#: Python, numpy and onnx fit in this address space; a 160 MB upload on top does not.
LIMIT = 256 * 1024**2
BIG = 40_000_000  # float32 elements: 160 MB


def _model(n: int) -> bytes:
    weights = numpy_helper.from_array(np.zeros(n, np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])], "add",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n])], initializer=[weights])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


@pytest.fixture
def bounded_api(tmp_path: Path) -> Iterator[TestClient]:
    settings = make_settings(tmp_path, inspect_memory_bytes=LIMIT,
                             max_dataset_bytes=256 * 1024**2)
    settings.max_upload_bytes = 256 * 1024**2
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        client.headers["Authorization"] = bearer()
        yield client


def test_a_model_whose_parse_exhausts_the_limit_is_413_and_the_api_serves_on(bounded_api):
    response = bounded_api.post("/v1/models", files={"file": ("big.onnx", _model(BIG))})
    assert response.status_code == 413, response.text
    body = response.json()
    assert body["code"] == "resource_limit"
    assert body["details"]["limit"] == "address_space"
    assert body["details"]["stage"] == "inspect_model"
    assert bounded_api.get("/v1/models").json() == []  # nothing recorded

    small = bounded_api.post("/v1/models", files={"file": ("small.onnx", _model(4))})
    assert small.status_code == 201, small.text
    assert small.json()["inputs"][0]["shape"] == [4]


def test_a_dataset_whose_inspection_exhausts_the_limit_is_413(bounded_api):
    buffer = io.BytesIO()
    np.savez(buffer, x=np.zeros((BIG // 4, 4), np.float32))
    response = bounded_api.post("/v1/datasets", files={"file": ("big.npz", buffer.getvalue())})
    assert response.status_code == 413, response.text
    assert response.json()["code"] == "resource_limit"
    assert response.json()["details"]["stage"] == "inspect_dataset"
    assert bounded_api.get("/v1/datasets").json() == []

    buffer = io.BytesIO()
    np.savez(buffer, x=np.zeros((2, 4), np.float32))
    ok = bounded_api.post("/v1/datasets", files={"file": ("small.npz", buffer.getvalue())})
    assert ok.status_code == 201, ok.text

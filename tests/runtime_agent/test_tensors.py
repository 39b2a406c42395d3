"""Tensors into and out of an executor: DLPack inputs without copies, ``out=`` buffers the engine
writes in place, output shapes known before the run, and what is refused."""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
import torch

from runtime_agent.executors import Executor, OnnxRuntimeExecutor, load_executor
from runtime_agent.executors.tensors import DeviceTensor, InputCheck, OutputShapes, from_dlpack
from schemas.errors import InvalidRequest
from schemas.manifest import TensorSpec
from tests.runtime_agent.test_executors import make_artifact

X = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)


@pytest.fixture
def executor(tmp_path: Path) -> OnnxRuntimeExecutor:
    loaded = load_executor(tmp_path, make_artifact(tmp_path))
    assert isinstance(loaded, OnnxRuntimeExecutor)
    return loaded


def _expected(executor: OnnxRuntimeExecutor, x: np.ndarray) -> np.ndarray:
    return executor.session.run(None, {"x": x})[0]


def test_a_torch_tensor_is_read_in_place(executor: OnnxRuntimeExecutor) -> None:
    tensor = torch.from_numpy(X.copy())
    feed = executor._check({"x": tensor})
    assert feed["x"].ctypes.data == tensor.data_ptr()  # the engine is handed the tensor's memory
    np.testing.assert_array_equal(executor.run({"x": tensor})["y"], _expected(executor, X))


def test_out_buffers_are_written_in_place(executor: OnnxRuntimeExecutor) -> None:
    out = torch.full((4, 16), float("nan"))
    result = executor.run({"x": torch.from_numpy(X)}, out={"y": out})
    assert result["y"] is out
    # onnxruntime's own view of the output it wrote: the caller's memory.
    assert executor._binding().get_outputs()[0].data_ptr() == out.data_ptr()
    np.testing.assert_array_equal(out.numpy(), _expected(executor, X))
    buffer = np.zeros((4, 16), np.float32)
    assert executor.run({"x": X}, out={"y": buffer})["y"] is buffer
    np.testing.assert_array_equal(buffer, _expected(executor, X))


@pytest.mark.parametrize("bound", [False, True], ids=["session run", "io binding"])
def test_outputs_are_fresh_on_every_call(executor: OnnxRuntimeExecutor, bound: bool) -> None:
    """Outputs without a caller's buffer come from onnxruntime's allocator: through the
    session's run (host inputs), or an IOBinding that binds them afresh on every run (device
    memory, and the outputs beside out= buffers) — never a buffer a later run overwrites."""
    def run(x: np.ndarray) -> np.ndarray:
        return (executor._run_into({"x": x}, {}) if bound else executor.run({"x": x}))["y"]

    first = run(X)
    kept = first.copy()
    if bound:  # returned without a copy: the memory onnxruntime wrote
        assert executor._binding().get_outputs()[0].data_ptr() == first.ctypes.data
    for batch in (4, 1, 5):
        x = np.random.default_rng(batch).standard_normal((batch, 64)).astype(np.float32)
        y = run(x)
        assert y.shape == (batch, 16) and y.ctypes.data != first.ctypes.data
        np.testing.assert_array_equal(y, _expected(executor, x))
    np.testing.assert_array_equal(first, kept)  # a later run never overwrites what was returned


def test_an_output_of_unknown_shape_is_left_to_onnxruntime(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    manifest = make_artifact(tmp_path)
    manifest.outputs = [TensorSpec(name="y", dtype="float32", shape=["M", 16])]
    with caplog.at_level(logging.DEBUG, logger="runtime_agent.executors.onnxruntime.executor"):
        loaded = load_executor(tmp_path, manifest)
    assert "output 'y' has no shape before the run" in caplog.text
    assert "dimension 'M' is not a dimension of any input" in caplog.text
    y = loaded.run({"x": X})["y"]
    np.testing.assert_array_equal(y, loaded.session.run(None, {"x": X})[0])


def test_a_non_contiguous_tensor_is_copied_once_and_logged(
        executor: OnnxRuntimeExecutor, caplog: pytest.LogCaptureFixture) -> None:
    strided = torch.from_numpy(np.ascontiguousarray(X.T)).T  # the right shape, column-major
    assert not strided.is_contiguous()
    with caplog.at_level(logging.DEBUG, logger="runtime_agent.executors.tensors"):
        y = executor.run({"x": strided})["y"]
    assert "copying a non-contiguous array of shape [4, 64]" in caplog.text
    np.testing.assert_array_equal(y, _expected(executor, X))
    # the same for a numpy view
    np.testing.assert_array_equal(executor.run({"x": X.T.copy().T})["y"],
                                  _expected(executor, X))


class _CudaTensor:
    """A stand-in for a CUDA tensor (no GPU here): it answers the DLPack and CUDA array
    interface questions a torch or CuPy tensor on ``cuda:0`` answers, and owns no memory."""

    def __init__(self, shape: tuple[int, ...], strides: tuple[int, ...] | None = None) -> None:
        self.__cuda_array_interface__ = {"shape": shape, "typestr": "<f4", "strides": strides,
                                         "data": (0xDEAD000, False), "version": 3}

    def __dlpack__(self, **_: object) -> object:
        raise AssertionError("a CUDA tensor must not be read through host DLPack")

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, 0)


def test_a_cuda_tensor_is_refused_by_a_cpu_engine(executor: OnnxRuntimeExecutor) -> None:
    with pytest.raises(InvalidRequest, match=r"input 'x' is on cuda:0; this engine runs on cpu"
                                             r".*tensor.cpu\(\)"):
        executor.run({"x": _CudaTensor((4, 64))})
    with pytest.raises(InvalidRequest, match=r"out 'y' is on cuda:0"):
        executor.run({"x": X}, out={"y": _CudaTensor((4, 16))})


def test_a_cuda_tensor_stays_on_the_device_for_a_cuda_engine() -> None:
    tensor = from_dlpack("x", _CudaTensor((4, 64)), device="cuda")
    assert isinstance(tensor, DeviceTensor)
    assert (tensor.pointer, tensor.shape, tensor.dtype, tensor.device_id) == (
        0xDEAD000, (4, 64), np.dtype(np.float32), 0)
    check = InputCheck([TensorSpec(name="x", dtype="float32", shape=["N", 64])], "cuda",
                       device_memory=True)
    assert check({"x": _CudaTensor((4, 64))})["x"].pointer == 0xDEAD000
    with pytest.raises(InvalidRequest, match="expected dimension 1 to be 64"):
        check({"x": _CudaTensor((4, 63))})
    with pytest.raises(InvalidRequest, match=r"non-contiguous CUDA tensor.*contiguous\(\)"):
        from_dlpack("x", _CudaTensor((4, 64), strides=(4, 16)), device="cuda")
    # An executor that reads host arrays (AOTInductor, TensorRT) refuses device memory.
    with pytest.raises(InvalidRequest, match=r"takes host arrays even for an engine on CUDA"):
        InputCheck([TensorSpec(name="x", dtype="float32", shape=["N", 64])], "cuda",
                   device_memory=False)({"x": _CudaTensor((4, 64))})


def test_bad_tensors_are_refused_with_reasons(executor: OnnxRuntimeExecutor) -> None:
    with pytest.raises(InvalidRequest, match=r"could not be read through DLPack.*gradient"):
        executor.run({"x": torch.ones(4, 64, requires_grad=True)})
    with pytest.raises(InvalidRequest, match=r"expected dtype float32.*given float64"):
        executor.run({"x": torch.ones(4, 64, dtype=torch.float64)})
    with pytest.raises(InvalidRequest, match=r"expected a numpy array or a DLPack tensor"):
        executor.run({"x": "not a tensor"})


@pytest.mark.parametrize(
    ("out", "message"),
    [
        ({"z": np.zeros((4, 16), np.float32)}, r"'z', which is not an output.*\['y'\]"),
        ({"y": np.zeros((4, 16), np.float64)}, "expected dtype float32; given float64"),
        ({"y": np.zeros((5, 16), np.float32)}, r"expected shape \[4, 16\].*given \[5, 16\]"),
        ({"y": np.zeros((16, 4), np.float32).T}, "not contiguous"),
        ({"y": np.zeros((4, 16), np.float32)[:, :].view()}, None),
    ],
)
def test_out_buffers_that_do_not_fit_are_refused(executor: OnnxRuntimeExecutor, out: dict,
                                                 message: str | None) -> None:
    if message is None:  # a writable view that fits is fine
        executor.run({"x": X}, out=out)
        return
    with pytest.raises(InvalidRequest, match=message):
        executor.run({"x": X}, out=out)


def test_a_read_only_out_buffer_is_refused(executor: OnnxRuntimeExecutor) -> None:
    buffer = np.zeros((4, 16), np.float32)
    buffer.flags.writeable = False
    with pytest.raises(InvalidRequest, match="read-only"):
        executor.run({"x": X}, out={"y": buffer})


def test_output_shapes_follow_the_inputs_dimension_names() -> None:
    shapes = OutputShapes(
        [TensorSpec(name="ids", dtype="int64", shape=["batch", "seq"]),
         TensorSpec(name="mask", dtype="int64", shape=["batch", "seq"])],
        [TensorSpec(name="hidden", dtype="float32", shape=["batch", "seq", 768]),
         TensorSpec(name="pooled", dtype="float32", shape=["batch", 768]),
         TensorSpec(name="topk", dtype="int64", shape=["batch", "k"]),
         TensorSpec(name="any", dtype="float32", shape=["..."])])
    feed = {"ids": np.zeros((2, 7), np.int64), "mask": np.zeros((2, 7), np.int64)}
    assert shapes.shape("hidden", feed) == (2, 7, 768)
    assert shapes.shape("pooled", feed) == (2, 768)
    assert shapes.shape("topk", feed) is None and shapes.shape("any", feed) is None
    assert set(shapes.unknown) == {"topk", "any"} and not shapes.static


class _CopyingExecutor(Executor):
    """A minimal executor that, like the AOTInductor and TensorRT ones, returns fresh arrays:
    the base class copies them into ``out`` buffers."""

    backend = "onnxruntime"
    runtime = "onnxruntime"

    @classmethod
    def probe_version(cls) -> str | None:
        return None

    @classmethod
    def supports(cls, fingerprint: object) -> bool:
        return True

    @classmethod
    def fingerprint_key(cls, fingerprint: object) -> str:
        return "test"

    @classmethod
    def compatible(cls, built_on: object, node: object, runtime_config: object = None) -> bool:
        return True

    def _load(self) -> None:
        pass

    def _run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"y": inputs["x"][:, :16] * 2}


def test_executors_without_binding_copy_into_out() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        executor = _CopyingExecutor(Path(tmp), make_artifact(Path(tmp)))
    out = torch.zeros(4, 16)
    assert executor.run({"x": torch.from_numpy(X)}, out={"y": out})["y"] is out
    np.testing.assert_array_equal(out.numpy(), X[:, :16] * 2)

"""Executor twin of ``compiler_worker.backends.tensorrt``: runs a serialized TensorRT plan.

What has been run, and what has not. This module imports on any machine: ``tensorrt`` and the
CUDA array library are imported when an engine loads. Its key and compatibility rules
(``schemas.technologies.tensorrt``) are plain Python and unit-tested. Loading and running a
plan (``_load``, ``_run``, the device-memory helpers) are written against TensorRT's documented
Python API (TensorRT >= 8.5: ``trt.Runtime``, ``deserialize_cuda_engine``, name-based I/O
tensors, ``set_input_shape``, ``set_tensor_address``, ``execute_async_v3``) and the documented
APIs of ``torch`` / ``cuda-python``, but have NOT been run: no machine this was written on had
TensorRT or a GPU, and nothing here is ever faked. Treat the first GPU run as their first test.

Keys and compatibility (TensorRT's "Hardware Compatibility" and "Version Compatibility"):
``schemas.technologies.tensorrt`` (``TensorRTRules``).

``runtime_config`` keys (written by the backend): ``hardware_compatibility_level``,
``version_compatible``, ``precision``, ``profiles``, ``plugin_libraries``. Plugin libraries are
not loaded here: the agent's plugin loader loads them into the process before the engine.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from importlib.util import find_spec
from typing import Any

import numpy as np

from runtime_agent.executors.base import Executor
from runtime_agent.fingerprint import package_version, version_tuple
from runtime_agent.samples import numpy_dtype
from schemas.errors import BackendUnavailable, InvalidRequest, KilnError
from schemas.technologies.tensorrt import (
    AMPERE,
    COMPAT_MIN_TRT,
    INTEGRATED_COMPUTE_CAPABILITIES,
    TensorRTRules,
    compute_capability,
    cuda_device,
    is_integrated,
)

__all__ = ["AMPERE", "COMPAT_MIN_TRT", "DISTRIBUTIONS", "ENGINE_MEDIA_TYPE",
           "HARDWARE_COMPATIBILITY_LEVELS", "INTEGRATED_COMPUTE_CAPABILITIES", "DeviceMemory",
           "TensorRTExecutor", "compute_capability", "cuda_device", "device_memory",
           "is_integrated", "logging_bridge"]

logger = logging.getLogger(__name__)

#: Media type of a serialized TensorRT plan.
ENGINE_MEDIA_TYPE = "application/x-tensorrt-plan"
#: Distributions that install TensorRT's Python bindings, in the order they are asked.
DISTRIBUTIONS = ("tensorrt", "tensorrt-cu13", "tensorrt-cu12", "tensorrt-cu11", "tensorrt-libs")

#: ``hardware_compatibility_level`` values → ``trt.HardwareCompatibilityLevel`` member names.
HARDWARE_COMPATIBILITY_LEVELS = {
    "none": "NONE",
    "ampere_plus": "AMPERE_PLUS",
    "same_compute_capability": "SAME_COMPUTE_CAPABILITY",
}


class TensorRTExecutor(TensorRTRules, Executor):
    """Loads ``engine.plan`` with ``trt.Runtime`` and runs it on the fingerprint's first GPU.

    Device buffers come from ``torch`` when it is installed, else from ``cuda-python``'s CUDA
    runtime bindings; with neither, loading raises ``BackendUnavailable``.
    """

    platform = "tensorrt_plan"
    media_types = {ENGINE_MEDIA_TYPE: ".plan"}

    @classmethod
    def probe_version(cls) -> str | None:
        """The installed TensorRT version: package metadata, else — for TensorRT installed from
        system packages (JetPack's ``python3-libnvinfer``), which carry no Python metadata —
        the module's ``__version__``, importing it only when it is there."""
        version = package_version(*DISTRIBUTIONS)
        if version is not None:
            return version
        try:
            if find_spec("tensorrt") is None:
                return None
            import tensorrt
        except Exception as exc:  # a broken installation is the same as none
            logger.debug("tensorrt is present but does not import: %s", exc)
            return None
        return str(getattr(tensorrt, "__version__", "")) or None

    # -- loading and running (needs TensorRT and a GPU; not run here) -----------------------

    def _load(self) -> None:
        try:
            import tensorrt as trt
        except ImportError as exc:
            raise BackendUnavailable(
                f"the {self.backend!r} executor needs TensorRT, which is not installed on this "
                f"node: {exc}",
                backend=self.backend,
            ) from exc
        if version_tuple(trt.__version__)[:2] < (8, 5):
            raise BackendUnavailable(
                f"the {self.backend!r} executor needs TensorRT >= 8.5 (name-based I/O tensors); "
                f"this node has {trt.__version__}"
            )
        config = self.manifest.runtime_config
        self._trt = trt
        self._logger = logging_bridge(trt)
        trt.init_libnvinfer_plugins(self._logger, "")
        self._runtime = trt.Runtime(self._logger)  # must outlive the engine
        if config.get("version_compatible") is True:
            # A version-compatible plan carries TensorRT's lean runtime (host code). The agent
            # only loads artifacts whose signed manifest a trusted key verified.
            self._runtime.engine_host_code_allowed = True
        path = self.blob_path("engine")
        engine = self._runtime.deserialize_cuda_engine(path.read_bytes())
        if engine is None:
            plugins = config.get("plugin_libraries") or []
            raise BackendUnavailable(
                f"TensorRT {trt.__version__} could not deserialize {path} of artifact "
                f"{self.manifest.artifact_id} (built with TensorRT "
                f"{self.manifest.build_fingerprint.runtimes.get('tensorrt')}): "
                f"{self._logger.errors}"
                + (f"; the plan needs plugin libraries {plugins}" if plugins else ""),
                artifact_id=self.manifest.artifact_id,
            )
        self._engine = engine
        self._context = engine.create_execution_context()
        if self._context is None:
            raise BackendUnavailable(
                f"TensorRT could not create an execution context for artifact "
                f"{self.manifest.artifact_id}: {self._logger.errors}"
            )
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        self._engine_inputs = [n for n in names
                               if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self._engine_outputs = [n for n in names if n not in self._engine_inputs]
        if set(self._engine_inputs) != set(self._inputs) or \
                not set(self._output_names) <= set(self._engine_outputs):
            raise BackendUnavailable(
                f"the plan of artifact {self.manifest.artifact_id} has inputs "
                f"{self._engine_inputs} and outputs {self._engine_outputs}; the manifest lists "
                f"inputs {sorted(self._inputs)} and outputs {self._output_names}"
            )
        self._dtypes = {n: _numpy_dtype(trt, engine.get_tensor_dtype(n)) for n in names}
        self._memory = device_memory()
        self._lock = threading.Lock()  # an execution context runs one inference at a time
        logger.debug("loaded %s (%d I/O tensors)", path, len(names))

    def _run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        context, dtypes = self._context, self._dtypes
        with self._lock, self._memory.buffers() as buffers:
            for name in self._engine_inputs:
                # ONNX int64 inputs may be int32 in the plan (TensorRT < 10): cast to the plan.
                array = np.ascontiguousarray(inputs[name], dtype=dtypes[name])
                if not context.set_input_shape(name, tuple(array.shape)):
                    raise InvalidRequest(
                        f"input {name!r} of shape {list(array.shape)} is outside the plan's "
                        f"optimization profile {self.manifest.runtime_config.get('profiles')}",
                        artifact_id=self.manifest.artifact_id,
                    )
                context.set_tensor_address(name, buffers.upload(name, array))
            unresolved = list(context.infer_shapes() or [])
            if unresolved:
                raise InvalidRequest(
                    f"TensorRT cannot infer the shapes of {unresolved} from the given inputs "
                    f"(artifact {self.manifest.artifact_id})"
                )
            for name in self._engine_outputs:
                shape = tuple(context.get_tensor_shape(name))
                if any(d < 0 for d in shape):
                    raise BackendUnavailable(
                        f"output {name!r} has a data-dependent shape {list(shape)}; this "
                        f"executor does not implement TensorRT's output allocator"
                    )
                context.set_tensor_address(name, buffers.empty(name, shape, dtypes[name]))
            if not context.execute_async_v3(buffers.stream_handle):
                raise KilnError(
                    f"TensorRT failed to run artifact {self.manifest.artifact_id}: "
                    f"{self._logger.errors[-5:]}"
                )
            outputs = {name: buffers.download(name, dtypes[name])
                       for name in self._engine_outputs}
        wanted = {spec.name: numpy_dtype(spec.dtype) for spec in self.manifest.outputs}
        return {name: value.astype(wanted[name], copy=False) if name in wanted else value
                for name, value in outputs.items()}


# -- TensorRT plumbing ---------------------------------------------------------------------

def logging_bridge(trt: Any, log: logging.Logger = logger) -> Any:
    """A ``trt.ILogger`` that forwards TensorRT's messages to ``log`` and keeps the errors
    (for the exception of a failed build or load)."""
    severity = trt.ILogger.Severity
    levels = {
        severity.INTERNAL_ERROR: logging.CRITICAL,
        severity.ERROR: logging.ERROR,
        severity.WARNING: logging.WARNING,
        severity.INFO: logging.INFO,
        severity.VERBOSE: logging.DEBUG,
    }

    class LoggingBridge(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, level: Any, message: str) -> None:
            python_level = levels.get(level, logging.INFO)
            log.log(python_level, "TensorRT: %s", message)
            if python_level >= logging.ERROR:
                self.errors.append(message)

    return LoggingBridge()


def _numpy_dtype(trt: Any, dtype: Any) -> np.dtype:
    """The numpy dtype of a ``trt.DataType`` (bfloat16 through ``ml_dtypes``)."""
    names = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT8": "int8",
             "UINT8": "uint8", "INT32": "int32", "INT64": "int64", "BOOL": "bool"}
    for member, name in names.items():
        if getattr(trt.DataType, member, None) == dtype:
            return numpy_dtype(name)
    raise BackendUnavailable(f"TensorRT I/O type {dtype} has no numpy equivalent")


# -- device memory: torch if installed, else cuda-python -----------------------------------

class _TorchBuffers:
    """One inference's device buffers as torch tensors, copied on the executor's stream."""

    def __init__(self, torch: Any, stream: Any) -> None:
        self.torch, self.stream = torch, stream
        self.stream_handle = int(stream.cuda_stream)
        self._tensors: dict[str, Any] = {}

    def _host(self, array: np.ndarray) -> Any:
        if array.dtype.name == "bfloat16":  # torch.from_numpy does not know ml_dtypes
            return self.torch.from_numpy(array.view(np.int16)).view(self.torch.bfloat16)
        return self.torch.from_numpy(array)

    def upload(self, name: str, array: np.ndarray) -> int:
        with self.torch.cuda.stream(self.stream):
            self._tensors[name] = self._host(array).to("cuda", non_blocking=False)
        return int(self._tensors[name].data_ptr())

    def empty(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> int:
        with self.torch.cuda.stream(self.stream):
            self._tensors[name] = self.torch.empty_like(self._host(np.empty(shape, dtype)),
                                                        device="cuda")
        return int(self._tensors[name].data_ptr())

    def download(self, name: str, dtype: np.dtype) -> np.ndarray:
        self.stream.synchronize()
        host = self._tensors[name].cpu()
        if dtype.name == "bfloat16":
            return host.view(self.torch.int16).numpy().view(dtype)
        return host.numpy()

    def close(self) -> None:
        self._tensors.clear()


class _CudaRuntimeBuffers:
    """One inference's device buffers through ``cuda-python``'s CUDA runtime bindings."""

    def __init__(self, cudart: Any, stream: Any) -> None:
        self.cudart, self.stream = cudart, stream
        self.stream_handle = int(stream)
        self._buffers: dict[str, tuple[int, tuple[int, ...]]] = {}
        self._host: list[np.ndarray] = []  # host arrays live until their copies are done

    def _check(self, result: tuple[Any, ...]) -> Any:
        error, *values = result
        if error != self.cudart.cudaError_t.cudaSuccess:
            raise KilnError(f"CUDA runtime call failed: {error}")
        return values[0] if values else None

    def _allocate(self, name: str, shape: tuple[int, ...], nbytes: int) -> int:
        pointer = int(self._check(self.cudart.cudaMalloc(max(nbytes, 1))))
        self._buffers[name] = (pointer, shape)
        return pointer

    def upload(self, name: str, array: np.ndarray) -> int:
        pointer = self._allocate(name, array.shape, array.nbytes)
        self._host.append(array)
        self._check(self.cudart.cudaMemcpyAsync(
            pointer, array.ctypes.data, array.nbytes,
            self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, self.stream))
        return pointer

    def empty(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> int:
        return self._allocate(name, shape, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)

    def download(self, name: str, dtype: np.dtype) -> np.ndarray:
        pointer, shape = self._buffers[name]
        host = np.empty(shape, dtype)
        self._check(self.cudart.cudaMemcpyAsync(
            host.ctypes.data, pointer, host.nbytes,
            self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost, self.stream))
        self._check(self.cudart.cudaStreamSynchronize(self.stream))
        return host

    def close(self) -> None:
        self.cudart.cudaStreamSynchronize(self.stream)
        for pointer, _ in self._buffers.values():
            self.cudart.cudaFree(pointer)
        self._buffers.clear()
        self._host.clear()


class DeviceMemory:
    """Device buffers for inferences, all on one CUDA stream of the executor's own."""

    def __init__(self, library: str, module: Any) -> None:
        self.library, self.module = library, module
        if library == "torch":
            self.stream = module.cuda.Stream()
        else:
            error, self.stream = module.cudaStreamCreate()
            if error != module.cudaError_t.cudaSuccess:
                raise BackendUnavailable(f"cudaStreamCreate failed: {error}")

    @contextmanager
    def buffers(self) -> Iterator[_TorchBuffers | _CudaRuntimeBuffers]:
        """The buffers of one inference, released when it ends."""
        buffers = (_TorchBuffers(self.module, self.stream) if self.library == "torch"
                   else _CudaRuntimeBuffers(self.module, self.stream))
        try:
            yield buffers
        finally:
            buffers.close()


def device_memory() -> DeviceMemory:
    """Device memory through ``torch`` (with CUDA) when installed, else ``cuda-python``."""
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        return DeviceMemory("torch", torch)
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart  # cuda-python before 12.6
        except ImportError:
            cudart = None
    if cudart is not None:
        return DeviceMemory("cuda-python", cudart)
    raise BackendUnavailable(
        "the tensorrt executor needs a CUDA array library for device buffers: install torch "
        "(with CUDA) or cuda-python"
    )

"""Executor twin of ``compiler_worker.backends.onnxruntime``: runs a saved ONNX Runtime model.

``runtime_config`` keys (written by the backend):

- ``graph_optimization_level``: the level the *session* loads the engine with. The backend
  writes 0 (``ORT_DISABLE_ALL``): the engine file already is the optimized graph, and
  re-optimizing it at load would run a graph other than the one that was verified.
- ``providers``: execution providers, in order; each must be available here.
- ``thread_policy``: how many intra-op threads, resolved on the node that runs the engine
  against its own physical cores (``schemas.tuning.ThreadPolicy``: ``default`` leaves it to
  onnxruntime, ``physical``, ``half``, ``one``); engines never carry the tuning worker's
  core count.
- ``intra_op_num_threads`` / ``inter_op_num_threads``: a pinned count, set only when present
  (engines of earlier Kiln versions froze the tuned count here; it is still honoured, and it
  wins over ``thread_policy``).
- ``execution_mode``: ``sequential`` (default) or ``parallel``.
- ``session_config``: extra session configuration entries (e.g. MLAS's bf16 fast math).
- ``precision``: the numerics the engine computes in (``fp32``, ``int8-static-qdq``, ...).
- ``optimization_level``: the level the engine was built at; it decides portability.
- ``custom_ops``: one entry per custom op in the engine — ``op`` (``domain::OpType``),
  ``kind`` (``python`` or ``native``), ``entry`` (kernel ``module:function`` or library path
  in the bundle), ``plugin`` (bundle sha256) and, for native ones, ``abi``. Before creating
  its session the executor registers the Python kernels with onnxruntime-extensions (and its
  library) and each native library (``register_custom_ops_library``), from the plugins it was
  given (``runtime_agent.executors.onnxruntime.custom_ops.SessionCustomOps``).

Keys and compatibility: ``schemas.technologies.onnxruntime`` (``OnnxRuntimeRules``).

``onnxruntime`` is imported here and nowhere else in the runtime.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from runtime_agent.executors.base import CustomOpAdapter, Executor, physical_cores
from runtime_agent.executors.tensors import DeviceTensor
from runtime_agent.fingerprint import package_version, version_tuple
from runtime_agent.plugins.abi import platform_tag
from schemas.errors import BackendUnavailable, InvalidRequest
from schemas.technologies.onnxruntime import OnnxRuntimeRules
from schemas.tuning import ThreadPolicy

if TYPE_CHECKING:
    from runtime_agent.executors.onnxruntime.reference import OnnxRuntimeReference
    from runtime_agent.plugins import LoadedPlugin

logger = logging.getLogger(__name__)

#: Distributions that install onnxruntime.
DISTRIBUTIONS = ("onnxruntime", "onnxruntime-gpu")
#: Media type of a saved onnxruntime model.
ENGINE_MEDIA_TYPE = "application/x-onnx"
#: Prefix of this runtime's ABI tag for native custom-op libraries (``ort-api-<N>``).
ORT_API_PREFIX = "ort-api-"
_LEVELS = {
    0: "ORT_DISABLE_ALL",
    1: "ORT_ENABLE_BASIC",
    2: "ORT_ENABLE_EXTENDED",
    3: "ORT_ENABLE_ALL",
}


def onnxruntime_api_version(version: str | None = None) -> int | None:
    """The onnxruntime C API version (``ORT_API_VERSION``) a runtime of ``version`` (default:
    the installed one) serves. In onnxruntime 1.x that is the minor version (1.32 serves API
    versions 1..32; ``GetApi(33)`` returns NULL), and the C API is append-only: a runtime
    serving ``M`` runs every library built for ``N <= M``. ``None`` without onnxruntime."""
    if version is None:
        version = package_version(*DISTRIBUTIONS, module="onnxruntime")
    parts = version_tuple(version)
    if len(parts) < 2 or parts[0] != 1:
        return None
    return parts[1]


def session_options(runtime_config: Mapping[str, Any]) -> Any:
    """``onnxruntime.SessionOptions`` for a manifest's ``runtime_config``."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    level = runtime_config.get("graph_optimization_level", 0)
    if level not in _LEVELS:
        raise InvalidRequest(
            f"runtime_config.graph_optimization_level must be one of {sorted(_LEVELS)}; "
            f"got {level!r}"
        )
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, _LEVELS[level])
    for key in ("intra_op_num_threads", "inter_op_num_threads"):
        value = runtime_config.get(key)
        if value is not None:
            setattr(options, key, int(value))
    policy = runtime_config.get("thread_policy")
    if policy is not None and runtime_config.get("intra_op_num_threads") is None:
        try:
            threads = ThreadPolicy(str(policy)).threads(physical_cores())
        except ValueError:
            raise InvalidRequest(
                f"runtime_config.thread_policy must be one of "
                f"{[p.value for p in ThreadPolicy]}; got {policy!r}") from None
        if threads is not None:
            options.intra_op_num_threads = threads
    mode = runtime_config.get("execution_mode", "sequential")
    if mode not in ("sequential", "parallel"):
        raise InvalidRequest(
            f"runtime_config.execution_mode must be sequential or parallel; got {mode!r}")
    options.execution_mode = (ort.ExecutionMode.ORT_PARALLEL if mode == "parallel"
                              else ort.ExecutionMode.ORT_SEQUENTIAL)
    for key, value in dict(runtime_config.get("session_config") or {}).items():
        options.add_session_config_entry(str(key), str(value))
    return options


def check_providers(requested: list[str]) -> list[str]:
    """The requested execution providers, each checked to be available in this onnxruntime."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    missing = [p for p in requested if p not in available]
    if missing or not requested:
        raise BackendUnavailable(
            f"Requested providers were: {requested}, but available providers are: {available}",
            requested=requested,
            available=available,
        )
    return requested


class OnnxRuntimeExecutor(OnnxRuntimeRules, Executor):
    """Loads ``engine.onnx`` into an ``onnxruntime.InferenceSession``."""

    platform = "onnxruntime_onnx"
    media_types = {ENGINE_MEDIA_TYPE: ".onnx"}
    supports_plugins = True
    binds_device_memory = True
    reference_formats = frozenset({"onnx"})

    @classmethod
    def reference(cls, model: Any, output_names: list[str],
                  description: str) -> OnnxRuntimeReference:
        from runtime_agent.executors.onnxruntime.reference import OnnxRuntimeReference

        return OnnxRuntimeReference(model, output_names, description)

    @classmethod
    def probe_version(cls) -> str | None:
        return package_version(*DISTRIBUTIONS, module="onnxruntime")

    @classmethod
    def custom_op_adapter(cls, plugins: Sequence[LoadedPlugin], ops: Iterable[str],
                          device: str) -> CustomOpAdapter | None:
        """The plugins' Python kernels (through onnxruntime-extensions) and native libraries,
        registered on a ``SessionOptions`` exactly as the executor does before loading."""
        from runtime_agent.executors.onnxruntime.custom_ops import SessionCustomOps

        return SessionCustomOps.resolve(list(plugins), set(ops), device)

    @classmethod
    def plugin_abi(cls) -> str | None:
        """``<os>-<arch>/ort-api-<N>``, ``N`` the C API version this onnxruntime serves. A
        library built against API ``N`` asks for it with ``OrtGetApiBase()->GetApi(N)``."""
        api = onnxruntime_api_version()
        return None if api is None else f"{platform_tag()}/{ORT_API_PREFIX}{api}"

    def _load(self) -> None:
        import onnxruntime as ort

        config = self.manifest.runtime_config
        providers: list = check_providers(list(config.get("providers", ["CPUExecutionProvider"])))
        path = self.blob_path("engine")
        options = session_options(config)
        custom_ops = list(config.get("custom_ops") or [])
        device = self.device_for(config)
        if custom_ops:
            from runtime_agent.executors.onnxruntime.custom_ops import SessionCustomOps

            SessionCustomOps.for_artifact(custom_ops, self.plugins, device).apply(options)
        self._run_options = None
        if device == "cuda" and self.stream is not None:
            # The engine's kernels go to the caller's stream, and a run returns without
            # synchronizing it: the caller orders its own work after them (as any op would).
            providers = [("CUDAExecutionProvider", {"user_compute_stream": str(self.stream)}),
                         *providers[1:]]
            self._run_options = ort.RunOptions()
            self._run_options.add_run_config_entry("disable_synchronize_execution_providers", "1")
        try:
            self.session = ort.InferenceSession(
                str(path), sess_options=options, providers=providers
            )
        except Exception as exc:  # onnxruntime raises its own untyped errors
            raise BackendUnavailable(
                f"onnxruntime {ort.__version__} could not load {path} of artifact "
                f"{self.manifest.artifact_id}: {exc}"
            ) from exc
        self._device = device
        self._local = threading.local()
        # Host inputs, outputs the engine allocates: the session's native run (what
        # InferenceSession.run calls after its own Python checks, which the signature check
        # here replaces). An IOBinding adds work per call on CPU that a small model feels
        # (`bench/agent.py --only overhead`); bindings serve out= buffers and device memory.
        native = getattr(self.session, "_sess", None)
        self._direct = native.run if device == "cpu" and native is not None else None
        for name, why in self._output_shapes.unknown.items():
            logger.debug("artifact %s: output %r has no shape before the run (%s): out= "
                         "cannot be checked for it and kiln.torch lets onnxruntime allocate it",
                         self.manifest.artifact_id, name, why)
        logger.debug("loaded %s with providers %s", path, providers)

    def _run_error(self, exc: Exception) -> InvalidRequest:
        # The feed matched the signature (names, dtypes, ranks, fixed dimensions) and the
        # engine ran on sample inputs before it was served: what remains is almost always an
        # input the graph cannot take (dynamic dimensions that do not agree, indices out of
        # range), so the caller hears onnxruntime's own reason.
        return InvalidRequest(
            f"the inputs match the signature of artifact {self.manifest.artifact_id}, but "
            f"onnxruntime could not run them: {exc}", artifact_id=self.manifest.artifact_id)

    def _binding(self) -> Any:
        """This thread's binding (a binding holds one run's buffers: one per thread).

        onnxruntime's Python ``IOBinding`` wraps a native ``SessionIOBinding`` and re-creates an
        ``OrtDevice`` on every ``bind_output`` call; those few microseconds are the whole budget
        of a small model, so the native binding is used directly where this onnxruntime has it
        (``_Binding``), and the public API otherwise."""
        try:
            return self._local.binding
        except AttributeError:
            self._local.binding = _Binding(self.session, self._device)
            return self._local.binding

    def _run(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        if self._direct is None:
            return self._run_into(inputs, {})
        try:
            values = self._direct(self._output_names, inputs, self._run_options)
        except Exception as exc:  # onnxruntime raises its own untyped errors
            raise self._run_error(exc) from exc
        return dict(zip(self._output_names, values, strict=True))

    def run(self, inputs: Mapping[str, Any], *,
            out: Mapping[str, Any] | None = None) -> dict[str, Any]:
        # The same checks as ``Executor.run``, minus two calls and a dict per run: the native
        # run returns exactly the outputs asked for, in order, so nothing is left to reorder or
        # look up. On a model of a few hundred microseconds those layers were the whole gap to
        # a bare InferenceSession (`bench/engines.py --models mlp`).
        if out or self._direct is None:
            return super().run(inputs, out=out)
        feed = self._check(inputs)
        try:
            values = self._direct(self._output_names, feed, self._run_options)
        except Exception as exc:  # onnxruntime raises its own untyped errors
            raise self._run_error(exc) from exc
        return dict(zip(self._output_names, values, strict=True))

    def run_prechecked(self, feed: Mapping[str, Any]) -> list[Any]:
        if self._direct is None:
            return super().run_prechecked(feed)
        try:
            return self._direct(self._output_names, feed, self._run_options)
        except Exception as exc:  # onnxruntime raises its own untyped errors
            raise self._run_error(exc) from exc

    def _run_into(self, feed: Mapping[str, Any], targets: Mapping[str, Any]) -> dict[str, Any]:
        """Bind the inputs' memory, the caller's output buffers (``targets``) and, for every
        other output, onnxruntime's own allocator, then run once.

        Outputs without a caller's buffer are allocated by onnxruntime from its arena, bound
        afresh on every run (a binding reuses the buffer of an output left bound, which would
        overwrite what the previous call returned) and returned as numpy views of that memory.
        Preallocating them here from the signature instead costs a fresh external buffer per
        call against the arena's reused one, which a small model feels (`bench/agent.py
        --only overhead`); the signature's shapes serve the callers that allocate (``out=``,
        ``kiln.torch``)."""
        binding = self._binding()
        for name, value in feed.items():
            if type(value) is np.ndarray:
                binding.bind_input(name, value)
            else:  # a DeviceTensor: CUDA memory, for an engine on CUDA
                binding.bind_device_input(name, value)
        results: dict[str, Any] = {}
        for name in self._output_names:
            target = targets.get(name)
            if target is None:
                binding.bind_allocated_output(name)
            elif type(target) is np.ndarray:
                results[name] = target
                binding.bind_output(name, target)
            else:
                results[name] = target.owner
                binding.bind_device_output(name, target)
        try:
            binding.run(self._run_options)
        except Exception as exc:  # onnxruntime raises its own untyped errors
            raise self._run_error(exc) from exc
        if len(results) == len(self._output_names):
            return results
        values = binding.get_outputs()
        return {name: results[name] if name in results else value.numpy()
                for name, value in zip(self._output_names, values, strict=True)}


class _Binding:
    """One thread's I/O binding on a session: host arrays and CUDA tensors bound in place."""

    def __init__(self, session: Any, device: str) -> None:
        import onnxruntime as ort

        self.public = session.io_binding()
        self._session = session
        native = getattr(self.public, "_iobinding", None)
        sess = getattr(session, "_sess", None)
        self._native = native if native is not None and sess is not None else None
        self._sess = sess
        self._host = ort.OrtDevice.make("cpu", 0)._get_c_device() if self._native else None
        self._device = device
        self._devices: dict[int, Any] = {}
        if self._native is not None:
            self.bind_input = self._native.bind_input  # type: ignore[method-assign]

    def bind_input(self, name: str, array: np.ndarray) -> None:
        self.public.bind_cpu_input(name, array)

    def bind_output(self, name: str, array: np.ndarray) -> None:
        if self._native is not None:
            self._native.bind_output(name, self._host, array.dtype, array.shape,
                                     array.ctypes.data)
        else:
            self.public.bind_output(name, "cpu", 0, array.dtype, array.shape, array.ctypes.data)

    def bind_allocated_output(self, name: str) -> None:
        if self._native is not None and self._device == "cpu":
            self._native.bind_output(name, self._host)
        else:
            self.public.bind_output(name, self._device, 0)

    def _cuda(self, device_id: int) -> Any:
        """onnxruntime's native description of CUDA device ``device_id``, made once."""
        device = self._devices.get(device_id)
        if device is None:
            import onnxruntime as ort

            device = self._devices[device_id] = ort.OrtDevice.make(
                "cuda", device_id)._get_c_device()
        return device

    def bind_device_input(self, name: str, tensor: DeviceTensor) -> None:
        if self._native is not None:
            self._native.bind_input(name, self._cuda(tensor.device_id), tensor.dtype,
                                    tensor.shape, tensor.pointer)
        else:
            self.public.bind_input(name, "cuda", tensor.device_id, tensor.dtype, tensor.shape,
                                   tensor.pointer)

    def bind_device_output(self, name: str, tensor: DeviceTensor) -> None:
        if self._native is not None:
            self._native.bind_output(name, self._cuda(tensor.device_id), tensor.dtype,
                                     tensor.shape, tensor.pointer)
        else:
            self.public.bind_output(name, "cuda", tensor.device_id, tensor.dtype,
                                    tensor.shape, tensor.pointer)

    def run(self, run_options: Any) -> None:
        if self._native is not None:
            self._sess.run_with_iobinding(self._native, run_options)
        else:
            self._session.run_with_iobinding(self.public, run_options)

    def get_outputs(self) -> Any:
        return self.public.get_outputs()

"""Custom ops in onnxruntime sessions: Python kernels through onnxruntime-extensions, native
libraries through ``SessionOptions.register_custom_ops_library``.

Python kernels. onnxruntime-extensions keeps one process-wide table of Python ops
(``onnx_op``) and registers all of them into every session that registers its library
(``get_library_path()``). Kiln adapts each op onto it once per process: element types map to
``PyCustomOpDef.dt_*`` (one type per argument), attributes to ``dt_int64`` / ``dt_float`` /
``dt_string``, and the registered function runs the kernel through ``invoke_kernel`` (outputs
pre-allocated from the shape function). The table cannot drop or replace an entry, and a
second entry for the same op would break *every* later session of the process, so a second
registration of the same op with a different implementation raises ``DuplicateOp`` before
anything reaches the table (the same implementation again is a no-op). Switching a Python
op's implementation therefore needs a new process.

The extensions library asks for outputs as ``(shape, flat values)`` and accepts any array
there; its default Python hook flattens outputs into Python lists, which costs more than the
kernel for large tensors. Kiln installs a hook that hands Kiln ops' outputs over as flat
contiguous arrays (copied once, by ``memcpy``) and passes every other op to the original hook.

Native libraries are registered per session, after their ABI was checked at load
(``runtime_agent.plugins.abi``). A session cannot register two libraries that both define
one domain (onnxruntime: "Domain already set in registry"): the extensions library used for
Python kernels defines ``ai.onnx.contrib``, so a model cannot mix Python kernels with a second
copy of that library.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime_agent.plugins.dispatch import KernelCall
from runtime_agent.plugins.errors import DuplicateOp, NoImplementation
from runtime_agent.plugins.loader import LoadedPlugin, plugins_of_entries
from runtime_agent.plugins.registry import NativeLibrary, OpDefinition, OpRegistry, PythonKernel
from schemas.errors import BackendUnavailable

logger = logging.getLogger(__name__)

__all__ = ["BACKEND", "SessionCustomOps", "extensions_library", "registered_python_ops"]

BACKEND = "onnxruntime"

#: Kiln dtype names → ``PyCustomOpDef`` attributes (float16/bfloat16 outputs are not
#: supported by the extensions' Python op API).
_DTYPES = {
    "float32": "dt_float", "float64": "dt_double", "int8": "dt_int8", "int16": "dt_int16",
    "int32": "dt_int32", "int64": "dt_int64", "uint8": "dt_uint8", "uint16": "dt_uint16",
    "uint32": "dt_uint32", "uint64": "dt_uint64", "bool": "dt_bool", "string": "dt_string",
    "complex64": "dt_complex64", "complex128": "dt_complex128",
}
_ATTRIBUTES = {"int": "dt_int64", "float": "dt_float", "string": "dt_string"}


@dataclass(frozen=True)
class _Registered:
    identity: str
    entry: str
    source: str
    op_id: int


_LOCK = threading.Lock()
_REGISTERED: dict[str, _Registered] = {}
_FAST_IDS: set[int] = set()
_HOOK: list[Any] = []


def _extensions() -> Any:
    try:
        import onnxruntime_extensions
    except ImportError as exc:
        raise BackendUnavailable(
            "Python custom-op kernels on onnxruntime need onnxruntime-extensions "
            "(pip install 'onnxruntime-extensions>=0.12'), which is not installed here"
        ) from exc
    return onnxruntime_extensions


def extensions_library() -> str:
    """The path of the onnxruntime-extensions library (the host of Python kernels)."""
    return _extensions().get_library_path()


def registered_python_ops() -> dict[str, str]:
    """Op → ``entry (plugin)`` of every Python op registered in this process."""
    with _LOCK:
        return {op: f"{r.entry} ({r.source})" for op, r in sorted(_REGISTERED.items())}


def _signature(definition: OpDefinition) -> tuple[list[int], list[int], dict[str, int]]:
    """The extensions' ``inputs``, ``outputs`` and ``attrs`` for ``definition``; raises
    ``NoImplementation`` for what its Python op API cannot express."""
    ox = _extensions()
    spec = definition.spec
    name = definition.name

    def element(arg: Any, kind: str) -> int:
        if len(arg.dtypes) != 1:
            raise NoImplementation(
                f"op {name}: {kind} {arg.name!r} accepts {arg.dtypes}; Python kernels on "
                f"onnxruntime bind one element type per argument (declare one, or one op per "
                f"type)", op=name,
            )
        if arg.optional:
            raise NoImplementation(
                f"op {name}: {kind} {arg.name!r} is optional; Python kernels on onnxruntime "
                f"take a fixed number of inputs and outputs", op=name,
            )
        code = _DTYPES.get(arg.dtypes[0])
        if code is None:
            raise NoImplementation(
                f"op {name}: {kind} {arg.name!r} is {arg.dtypes[0]}; Python kernels on "
                f"onnxruntime take {sorted(_DTYPES)}", op=name,
            )
        return getattr(ox.PyCustomOpDef, code)

    attrs: dict[str, int] = {}
    for attribute in spec.attributes:
        code = _ATTRIBUTES.get(attribute.type)
        if code is None:
            raise NoImplementation(
                f"op {name}: attribute {attribute.name!r} is {attribute.type}; Python kernels "
                f"on onnxruntime receive int, float and string attributes", op=name,
            )
        if attribute.default is None and not attribute.required:
            raise NoImplementation(
                f"op {name}: attribute {attribute.name!r} has no default and is not required; "
                f"onnxruntime-extensions reads every declared attribute from every node, so "
                f"give it a default (Kiln writes defaults into the compiled graph)", op=name,
            )
        attrs[attribute.name] = getattr(ox.PyCustomOpDef, code)
    return ([element(a, "input") for a in spec.inputs],
            [element(a, "output") for a in spec.outputs], attrs)


class _Dispatch:
    """What the extensions call for one op: the kernel through a ``KernelCall``."""

    def __init__(self, definition: OpDefinition, kernel: PythonKernel) -> None:
        self.call = KernelCall(definition, kernel)

    def __call__(self, *arrays: np.ndarray, **attributes: Any) -> Any:
        outputs = self.call(arrays, attributes)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)


def _install_hook(ox: Any) -> None:
    """Route Kiln ops' results to onnxruntime as flat arrays (see the module docstring)."""
    if _HOOK:
        return
    from onnxruntime_extensions import _ocos

    original = _ocos._on_pyop_invocation

    def hook(op_id: int, feed: Any, attributes: Any) -> tuple:
        if op_id not in _FAST_IDS:
            return original(op_id, feed, attributes)
        op = _ocos.Opdef._odlist[op_id]
        result = op.body(*feed, **op.cast_attributes(attributes))
        flat: list[Any] = [op_id]
        for array in result if isinstance(result, tuple) else (result,):
            flat.append(array.shape)
            flat.append(array.ravel().tolist() if array.dtype == np.dtype(object)
                        else np.ascontiguousarray(array).reshape(-1))
        return tuple(flat)

    ox.PyCustomOpDef.install_hooker(hook)
    _HOOK.append(hook)


def register_python_ops(bindings: Sequence[tuple[OpDefinition, PythonKernel]]) -> None:
    """Register each op's kernel with onnxruntime-extensions, once per process.

    Everything is checked before anything is registered: an op already registered with a
    different implementation raises ``DuplicateOp``; a signature the extensions cannot express
    raises ``NoImplementation``.
    """
    with _LOCK:
        plan = []
        for definition, kernel in bindings:
            prior = _REGISTERED.get(definition.name)
            if prior is not None:
                if prior.identity == kernel.identity:
                    continue
                raise DuplicateOp(
                    f"op {definition.name} already has a Python kernel in this process "
                    f"({prior.entry} from {prior.source}); onnxruntime-extensions cannot replace "
                    f"it with {kernel.entry} from {kernel.source or 'another source'} — load "
                    f"that plugin version in a new process (restart the agent)",
                    op=definition.name, registered=prior.source, refused=kernel.source,
                )
            plan.append((definition, kernel, _signature(definition)))
        if not plan:
            return
        ox = _extensions()
        _install_hook(ox)
        for definition, kernel, (inputs, outputs, attrs) in plan:
            opdef = ox.onnx_op(op_type=definition.name, inputs=inputs, outputs=outputs,
                               attrs=attrs)(_Dispatch(definition, kernel))
            op_id = opdef._nativedef.obj_id
            _FAST_IDS.add(op_id)
            _REGISTERED[definition.name] = _Registered(kernel.identity, kernel.entry,
                                                       kernel.source, op_id)
            logger.info("registered Python op %s (%s from %s) with onnxruntime-extensions",
                        definition.name, kernel.entry, kernel.source)


@dataclass(frozen=True)
class SessionCustomOps:
    """What one onnxruntime session must register for a model's custom ops."""

    python: tuple[tuple[OpDefinition, PythonKernel], ...] = ()
    libraries: tuple[NativeLibrary, ...] = ()
    device: str = "cpu"

    def __bool__(self) -> bool:
        return bool(self.python or self.libraries)

    @classmethod
    def resolve(cls, plugins: Sequence[LoadedPlugin], ops: Iterable[str],
                device: str = "cpu") -> SessionCustomOps:
        """The kernels of ``ops`` on onnxruntime/``device`` from ``plugins``; an op no plugin
        declares raises ``UnknownOp``, one without a kernel there ``NoImplementation``. Python
        kernels are checked against the extensions' API here (nothing is registered)."""
        registry = OpRegistry.union(p.registry for p in plugins)
        python: list[tuple[OpDefinition, PythonKernel]] = []
        libraries: dict[str, NativeLibrary] = {}
        for op in sorted(set(ops)):
            kernel = registry.kernel(op, BACKEND, device)
            if isinstance(kernel, PythonKernel):
                definition = registry.get(op)
                _signature(definition)
                python.append((definition, kernel))
            else:
                libraries.setdefault(str(kernel.path), kernel)
        return cls(tuple(python), tuple(libraries.values()), device)

    def runtime_config(self) -> list[dict[str, str]]:
        """What an artifact's ``runtime_config["custom_ops"]`` records: one entry per op."""
        entries = [{"op": d.name, "kind": "python", "entry": k.entry, "plugin": k.plugin_digest}
                   for d, k in self.python]
        for library in self.libraries:
            entries += [{"op": op, "kind": "native", "entry": library.entry,
                         "plugin": library.plugin_digest, "abi": library.abi}
                        for op in library.ops]
        return sorted(entries, key=lambda e: e["op"])

    @classmethod
    def for_artifact(cls, entries: Sequence[Mapping[str, Any]],
                     plugins: Sequence[LoadedPlugin], device: str = "cpu") -> SessionCustomOps:
        """An executor's side: resolve ``runtime_config["custom_ops"]`` against the loaded
        plugins, checking each op comes from the plugin (digest) and kind the artifact was
        built and verified with."""
        resolved = cls.resolve(plugins_of_entries(entries, plugins),
                               [e["op"] for e in entries], device)
        recorded = {(e["op"], e["kind"], e.get("entry"), e["plugin"]) for e in entries}
        actual = {(e["op"], e["kind"], e.get("entry"), e["plugin"])
                  for e in resolved.runtime_config()}
        if recorded - actual:
            raise NoImplementation(
                f"the loaded plugins implement the engine's custom ops differently than when it "
                f"was built: built with {sorted(recorded - actual)}, loaded "
                f"{sorted(actual - recorded)}")
        return resolved

    def apply(self, options: Any) -> list[str]:
        """Register the Python kernels (process-wide, once) and every library with session
        options ``options``; returns the libraries registered."""
        register_python_ops(self.python)
        paths = [str(library.path) for library in self.libraries]
        if self.python:
            paths.append(extensions_library())
        for path in paths:
            try:
                options.register_custom_ops_library(path)
            except Exception as exc:  # onnxruntime raises its own untyped errors
                owner = next((f"{lib.entry} of plugin {lib.source}" for lib in self.libraries
                              if str(lib.path) == path), "the onnxruntime-extensions library")
                raise BackendUnavailable(
                    f"onnxruntime could not register the custom-op library {owner} ({path}): "
                    f"{exc}", library=path,
                ) from exc
        return paths

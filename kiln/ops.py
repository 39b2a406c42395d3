"""Writing custom ops in Python: declare one, give it a shape function and kernels, try it on
numpy arrays, and write it out as a plugin folder (``plugin.json`` + module) that
``kiln plugin build`` packs.

::

    import numpy as np
    from kiln import ops

    swish = ops.custom_op("my.ops::Swish", inputs={"x": "float32"},
                          outputs={"y": "float32"}, attributes={"beta": 1.0})

    @swish.register_shape
    def swish_shape(inputs, attributes):          # device-free: the compiler calls it
        return [inputs[0]]

    @swish.register_kernel("onnxruntime", "cpu")
    def swish_cpu(ctx, inputs, outputs, attributes):
        x, y = inputs[0].numpy(), outputs[0].numpy()
        np.divide(x, 1 + np.exp(-attributes["beta"] * x), out=y)

    swish(np.ones((2, 3), np.float32), beta=2.0)  # runs swish_cpu, outputs pre-allocated
    ops.write_plugin("build/swish", name="my-swish", version="1.0.0", ops=[swish])

The decorators return the function unchanged, so a module written this way is also what the
bundle's entries point at (``swish:swish_cpu``). The runtime pieces (``TensorType``,
``TensorView``, ``KernelContext``, ``load_plugin``, ...) are re-exported from
``runtime_agent.plugins``. See docs/custom-ops.md.
"""

from __future__ import annotations

import inspect
import json
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from runtime_agent.plugins import (
    AbiMismatch,
    DuplicateOp,
    Kernel,
    KernelContext,
    LoadedPlugin,
    NoImplementation,
    OpDefinition,
    OpRegistry,
    PythonKernel,
    ScratchAllocator,
    ShapeFunction,
    ShapeFunctionError,
    TensorType,
    TensorView,
    UnknownOp,
    invoke_kernel,
    load_plugin,
    split_op,
)
from schemas.errors import InvalidRequest
from schemas.plugins import (
    DEFAULT_PLUGIN_BACKEND,
    AttributeSpec,
    Implementation,
    OpSpec,
    PluginManifest,
    TensorArg,
)

__all__ = [
    "AbiMismatch",
    "CustomOp",
    "DuplicateOp",
    "KernelContext",
    "LoadedPlugin",
    "NoImplementation",
    "OpRegistry",
    "ScratchAllocator",
    "ShapeFunctionError",
    "TensorType",
    "TensorView",
    "UnknownOp",
    "call",
    "custom_op",
    "load_plugin",
    "plugin_manifest",
    "write_plugin",
]

_ATTRIBUTE_TYPES: list[tuple[type, str]] = [(bool, ""), (int, "int"), (float, "float"),
                                            (str, "string")]


def _args(spec: Mapping[str, str | Sequence[str]] | Sequence[TensorArg]) -> list[TensorArg]:
    if isinstance(spec, Mapping):
        return [TensorArg(name=name, dtypes=[dtypes] if isinstance(dtypes, str) else list(dtypes))
                for name, dtypes in spec.items()]
    return list(spec)


def _attribute(name: str, value: Any) -> AttributeSpec:
    if isinstance(value, AttributeSpec):
        if value.name != name:
            raise InvalidRequest(f"attribute {name!r} is given an AttributeSpec named "
                                 f"{value.name!r}")
        return value
    if isinstance(value, list | tuple):
        kind = "ints" if value and all(isinstance(v, int) and not isinstance(v, bool)
                                       for v in value) else "floats"
        return AttributeSpec(name=name, type=kind, default=list(value))
    for python_type, kind in _ATTRIBUTE_TYPES:
        if isinstance(value, python_type):
            if not kind:
                break
            return AttributeSpec(name=name, type=kind, default=value)
    raise InvalidRequest(
        f"attribute {name!r}: give a default int, float, str or list of them (the type follows "
        f"from it), or an AttributeSpec (e.g. required=True); got {value!r}")


class CustomOp:
    """One op being written: its ``OpSpec``, shape function and kernels per (backend, device)."""

    def __init__(self, spec: OpSpec) -> None:
        self.spec = spec
        self.shape_function: ShapeFunction | None = None
        self.kernels: dict[tuple[str, str], Kernel] = {}

    @property
    def name(self) -> str:
        return self.spec.qualified_name

    def register_shape(self, function: ShapeFunction) -> ShapeFunction:
        """Decorator: the device-free shape function ``(input_types, attributes) ->
        output_types`` (``torch.library.register_fake``'s role). Once only."""
        if self.shape_function is not None:
            raise DuplicateOp(f"op {self.name} already has a shape function "
                              f"({self.shape_function.__name__})", op=self.name)
        self.shape_function = function
        return function

    def register_kernel(self, backend: str = DEFAULT_PLUGIN_BACKEND,
                        device: str = "cpu") -> Callable[[Kernel], Kernel]:
        """Decorator: the Python kernel ``(ctx, inputs, outputs, attributes) -> None`` for
        ``backend``/``device``. A second kernel for the same target raises ``DuplicateOp``."""
        def decorate(function: Kernel) -> Kernel:
            if (backend, device) in self.kernels:
                raise DuplicateOp(
                    f"op {self.name} already has a kernel for {backend}/{device} "
                    f"({self.kernels[(backend, device)].__name__})", op=self.name)
            self.kernels[(backend, device)] = function
            return function
        return decorate

    def definition(self) -> OpDefinition:
        """The op as the runtime registry holds it (spec, shape function, kernels)."""
        definition = OpDefinition(self.spec, self.shape_function, source=self.name)
        for (backend, device), function in self.kernels.items():
            definition.kernels[(backend, device)] = PythonKernel(
                op=self.name, backend=backend, device=device, function=function,
                entry=f"{function.__module__}:{function.__qualname__}", source=self.name)
        return definition

    def infer(self, *input_types: TensorType | None, **attributes: Any) -> list[TensorType]:
        """The output types the shape function gives (attributes completed with defaults)."""
        from runtime_agent.plugins import resolve_attributes

        return self.definition().infer(list(input_types),
                                       resolve_attributes(self.spec, attributes))

    def run(self, inputs: Sequence[Any], attributes: Mapping[str, Any] | None = None, *,
            backend: str = DEFAULT_PLUGIN_BACKEND, device: str = "cpu") -> list[np.ndarray]:
        """Run the kernel for ``backend``/``device`` on ``inputs`` (numpy arrays or DLPack
        tensors) exactly as a runtime would: outputs pre-allocated from the shape function."""
        definition = self.definition()
        kernel = definition.kernels.get((backend, device))
        if kernel is None:
            raise NoImplementation(
                f"op {self.name} has no implementation for backend {backend!r} on device "
                f"{device!r}; it has implementations for {definition.targets() or 'none'}",
                op=self.name, backend=backend, device=device, available=definition.targets())
        return invoke_kernel(definition, kernel, list(inputs), dict(attributes or {}))

    def __call__(self, *inputs: Any, **attributes: Any) -> Any:
        """Run the CPU kernel (the default plugin backend's, else any) on numpy inputs; one
        output is returned as an array, several as a tuple."""
        cpu = [target for target in self.kernels if target[1] == "cpu"]
        default = (DEFAULT_PLUGIN_BACKEND, "cpu")
        target = default if default in cpu else (cpu[0] if cpu else default)
        outputs = self.run(inputs, attributes, backend=target[0], device=target[1])
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def __repr__(self) -> str:
        return f"<CustomOp {self.name} kernels={sorted(self.kernels)}>"


def custom_op(
    name: str,
    *,
    inputs: Mapping[str, str | Sequence[str]] | Sequence[TensorArg],
    outputs: Mapping[str, str | Sequence[str]] | Sequence[TensorArg],
    attributes: Mapping[str, Any] | None = None,
    since_version: int = 1,
    doc: str = "",
) -> CustomOp:
    """Declare op ``name`` (``domain::OpType``).

    ``inputs``/``outputs``: name → dtype (numpy name, e.g. ``"float32"``) or list of dtypes,
    or ``TensorArg``s. ``attributes``: name → default value (its type gives the attribute's:
    int, float, str, list of ints or floats) or an ``AttributeSpec``.
    """
    domain, op_type = split_op(name)
    spec = OpSpec(domain=domain, op_type=op_type, since_version=since_version,
                  inputs=_args(inputs), outputs=_args(outputs),
                  attributes=[_attribute(k, v) for k, v in (attributes or {}).items()], doc=doc)
    return CustomOp(spec)


def call(plugin: LoadedPlugin | OpRegistry, op: str, *inputs: Any,
         backend: str = DEFAULT_PLUGIN_BACKEND, device: str = "cpu", **attributes: Any) -> Any:
    """Run ``op`` of a loaded plugin folder (``load_plugin``) on numpy inputs, as a runtime
    would; one output as an array, several as a tuple."""
    registry = plugin.registry if isinstance(plugin, LoadedPlugin) else plugin
    kernel = registry.kernel(op, backend, device)
    if not isinstance(kernel, PythonKernel):
        raise NoImplementation(f"op {op} is native on {backend}/{device}; run it in a session",
                               op=op)
    outputs = invoke_kernel(registry.get(op), kernel, list(inputs), attributes)
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


def _entry(function: Callable[..., Any], what: str, op: str) -> tuple[str, Path]:
    source = inspect.getsourcefile(function)
    if source is None or function.__qualname__ != function.__name__:
        raise InvalidRequest(f"the {what} of op {op} ({function!r}) must be a module-level "
                             f"function defined in a .py file")
    path = Path(source)
    return f"{path.stem}:{function.__name__}", path


def plugin_manifest(name: str, version: str, ops: Sequence[CustomOp], *, description: str = "",
                    requires: Sequence[str] = ()) -> tuple[PluginManifest, list[Path]]:
    """The ``PluginManifest`` of a plugin holding ``ops`` (each entry ``<file stem>:<function>``)
    and the module files it needs."""
    specs, implementations, files = [], [], []
    for op in ops:
        shape_entry = None
        if op.shape_function is not None:
            shape_entry, path = _entry(op.shape_function, "shape function", op.name)
            files.append(path)
        specs.append(op.spec.model_copy(update={"shape_function": shape_entry}))
        for (backend, device), function in sorted(op.kernels.items()):
            entry, path = _entry(function, f"{backend}/{device} kernel", op.name)
            files.append(path)
            implementations.append(Implementation(ops=[op.name], backend=backend, device=device,
                                                  kind="python", entry=entry))
    stems: dict[str, Path] = {}
    for path in files:
        if stems.setdefault(path.stem, path) != path:
            raise InvalidRequest(f"two modules named {path.stem}.py: {stems[path.stem]} and "
                                 f"{path}; a plugin's modules need distinct names")
    manifest = PluginManifest(name=name, version=version, description=description, ops=specs,
                              implementations=implementations, requires=list(requires))
    return manifest, sorted(set(stems.values()))


def write_plugin(folder: Path | str, *, name: str, version: str, ops: Sequence[CustomOp],
                 description: str = "", requires: Sequence[str] = ()) -> Path:
    """Write a plugin folder for ``ops``: the modules defining their functions and
    ``plugin.json``. Pack it with ``kiln plugin build FOLDER``."""
    folder = Path(folder)
    manifest, modules = plugin_manifest(name, version, ops, description=description,
                                        requires=requires)
    folder.mkdir(parents=True, exist_ok=True)
    for module in modules:
        if module.resolve() != (folder / module.name).resolve():
            shutil.copyfile(module, folder / module.name)
    data = manifest.model_dump(mode="json", exclude={"files"}, exclude_defaults=True)
    data.update(name=manifest.name, version=manifest.version)
    (folder / "plugin.json").write_text(json.dumps(data, indent=2) + "\n")
    return folder

"""Custom ops for PyTorch: a plugin's op registered as a ``torch.library`` custom op.

One registry, two frontends. An op declared once in a plugin manifest (``domain::OpType``,
its signature, attributes and device-free shape function) runs in onnxruntime through
``runtime_agent.executors.onnxruntime.custom_ops`` and in PyTorch through this module:

- the op becomes ``torch.ops.<namespace>.<OpType>``, the namespace being the domain with
  ``.`` turned into ``_`` (``kiln.examples::Swish`` → ``torch.ops.kiln_examples.Swish``), with
  the schema ``<OpType>(Tensor x, ..., *, float beta=1.0, ...) -> Tensor`` from the spec
  (optional inputs ``Tensor?``; attributes keyword-only, with their defaults);
- its **fake** (meta) implementation — what ``torch.export`` and Inductor trace with — is
  derived from the plugin's shape function: the input fake tensors' dtypes and shapes (a
  symbolic size becomes a named dimension) go in, empty tensors of the answered types come
  out, a named output dimension mapped back to the input's symbolic size;
- its **kernels** are the plugin's implementations for backend ``torch`` (Python functions
  ``kernel(*tensors, **attributes) -> Tensor | tuple[Tensor, ...]`` over torch tensors), one
  per device: ``cpu`` → the ``CPU`` dispatch key, ``cuda`` → ``CUDA`` (a Triton kernel, say).

Registrations are process-wide (the dispatcher has no scopes): the same kernel registered again
is a no-op; another kernel for an op already registered raises ``DuplicateOp`` naming both.
torch is imported only when ops are registered.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from runtime_agent.plugins.errors import DuplicateOp, NoImplementation, ShapeFunctionError
from runtime_agent.plugins.loader import LoadedPlugin
from runtime_agent.plugins.registry import OpDefinition, PythonKernel, split_op
from runtime_agent.plugins.types import TensorType
from schemas.errors import InvalidRequest
from schemas.plugins import torch_op_name as plugin_torch_op_name

logger = logging.getLogger(__name__)

#: The backend name plugin implementations for PyTorch declare.
TORCH_BACKEND = "torch"
#: Plugin device → torch dispatch key.
DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}
_ATTRIBUTE_TYPES = {"int": "int", "float": "float", "string": "str", "ints": "int[]",
                    "floats": "float[]"}
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

_lock = threading.Lock()
#: torch op name → (kernel identity per dispatch key, the Library objects keeping it alive).
_registered: dict[str, tuple[dict[str, str], list[Any]]] = {}


def torch_op_name(op: str) -> str:
    """``domain::OpType`` → ``namespace::OpType`` as torch names it (dots become ``_``;
    ``schemas.plugins.torch_op_name``), checked to be two identifiers."""
    split_op(op)
    name = plugin_torch_op_name(op)
    namespace, op_type = name.split("::")
    if not _IDENTIFIER.match(namespace) or not _IDENTIFIER.match(op_type):
        raise InvalidRequest(f"op {op} has no torch name: {name} is not two identifiers")
    return name


def torch_schema(definition: OpDefinition) -> str:
    """The ``torch.library`` schema of an op (without its namespace)."""
    spec = definition.spec
    args = [f"Tensor{'?' if arg.optional else ''} {arg.name}" for arg in spec.inputs]
    attributes = []
    for attribute in spec.attributes:
        kind = _ATTRIBUTE_TYPES[attribute.type]
        if attribute.default is not None:
            default = (f'"{attribute.default}"' if attribute.type == "string"
                       else repr(attribute.default).replace("(", "[").replace(")", "]"))
            attributes.append(f"{kind} {attribute.name}={default}")
        elif attribute.required:
            attributes.append(f"{kind} {attribute.name}")
        else:
            attributes.append(f"{kind}? {attribute.name}=None")
    if attributes:
        args += ["*", *attributes]
    outputs = ["Tensor"] * len(spec.outputs)
    returns = outputs[0] if len(outputs) == 1 else f"({', '.join(outputs)})"
    return f"{spec.op_type}({', '.join(args)}) -> {returns}"


def fake_from_shape_function(definition: OpDefinition):
    """A fake implementation for ``torch.library.register_fake``, from the op's shape
    function: symbolic input sizes pass through by name."""
    import torch

    spec = definition.spec
    names = [arg.name for arg in spec.inputs]

    def fake(*tensors, **attributes):
        if definition.shape_function is None:
            raise ShapeFunctionError(f"op {definition.name} has no shape function, so torch "
                                     f"cannot trace it (give the plugin one)", op=definition.name)
        symbols: dict[str, Any] = {}
        types: list[TensorType | None] = []
        for name, tensor in zip(names, tensors, strict=False):
            if tensor is None:
                types.append(None)
                continue
            dims: list[int | str] = []
            for axis, size in enumerate(tensor.shape):
                if isinstance(size, torch.SymInt):
                    token = f"{name}_{axis}"
                    symbols[token] = size
                    dims.append(token)
                else:
                    dims.append(int(size))
            types.append(TensorType(str(tensor.dtype).removeprefix("torch."), tuple(dims)))
        answered = definition.infer(types, {k: v for k, v in attributes.items()
                                            if v is not None})
        device = next((t.device for t in tensors if t is not None), None)
        outputs = []
        for index, out in enumerate(answered):
            if out.shape is None or any(d is None for d in out.shape):
                raise ShapeFunctionError(
                    f"op {definition.name}: the shape function left output {index} "
                    f"({out}) without a known shape; torch needs every size (an int or an "
                    f"input's dimension name)", op=definition.name)
            shape = []
            for dim in out.shape:
                if isinstance(dim, str):
                    if dim not in symbols:
                        raise ShapeFunctionError(
                            f"op {definition.name}: output {index} has dimension {dim!r}, "
                            f"which names no input dimension ({sorted(symbols)})",
                            op=definition.name)
                    shape.append(symbols[dim])
                else:
                    shape.append(int(dim))
            outputs.append(torch.empty(shape, dtype=getattr(torch, out.dtype), device=device))
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    return fake


@dataclass
class TorchCustomOps:
    """The custom ops of a model as torch ops: definitions and kernels per dispatch key.
    ``apply()`` registers them with the dispatcher (the ``CustomOpAdapter`` of backends that
    run torch programs)."""

    definitions: dict[str, OpDefinition]
    kernels: dict[str, list[tuple[str, PythonKernel]]]

    @classmethod
    def resolve(cls, plugins: Sequence[LoadedPlugin], ops: Iterable[str],
                devices: Iterable[str] = ("cpu",)) -> TorchCustomOps:
        """The definitions of ``ops`` (Kiln names, ``domain::OpType``) in ``plugins`` and their
        ``torch`` kernels for ``devices``; ``NoImplementation`` for an op without a kernel for
        the first device (the others are optional: a CUDA kernel where a GPU is present)."""
        devices = list(devices)
        definitions: dict[str, OpDefinition] = {}
        kernels: dict[str, list[tuple[str, PythonKernel]]] = {}
        for op in sorted(set(ops)):
            for plugin in plugins:
                if op not in plugin.registry.ops():
                    continue
                definition = plugin.registry.get(op)
                definitions[op] = definition
                for device in devices:
                    kernel = definition.kernels.get((TORCH_BACKEND, device))
                    if isinstance(kernel, PythonKernel):
                        kernels.setdefault(op, []).append((DISPATCH_KEYS[device], kernel))
                break
            if op not in definitions:
                raise NoImplementation(f"op {op} is declared by none of the plugins "
                                       f"{[p.label for p in plugins]}", op=op)
            if not any(key == DISPATCH_KEYS[devices[0]] for key, _ in kernels.get(op, [])):
                raise NoImplementation(
                    f"op {op} has no implementation for backend {TORCH_BACKEND!r} on device "
                    f"{devices[0]!r}; it has {definitions[op].targets() or 'none'}",
                    op=op, backend=TORCH_BACKEND, device=devices[0],
                    available=definitions[op].targets())
        return cls(definitions, kernels)

    def apply(self, session_options: Any = None) -> None:
        """Register every op with torch's dispatcher (``session_options`` is unused: torch
        has one process-wide registry)."""
        for op, definition in self.definitions.items():
            register_op(definition, self.kernels.get(op, []))

    def runtime_config(self) -> list[dict[str, object]]:
        return [{"op": op, "torch_op": torch_op_name(op),
                 "kernels": {key: kernel.entry for key, kernel in self.kernels.get(op, [])},
                 "plugin": next((kernel.plugin_digest for _, kernel in self.kernels.get(op, [])),
                                "")}
                for op in sorted(self.definitions)]


def register_op(definition: OpDefinition, kernels: Sequence[tuple[str, PythonKernel]]) -> str:
    """Define ``definition`` as a torch op with its fake implementation and ``kernels``
    (dispatch key, kernel); returns the torch name. Idempotent for the same kernels."""
    import torch

    name = torch_op_name(definition.name)
    namespace, op_type = name.split("::")
    wanted = {key: kernel.identity or kernel.entry for key, kernel in kernels}
    with _lock:
        known = _registered.get(name)
        if known is not None:
            identities, libraries = known
            clash = {k: v for k, v in wanted.items() if k in identities and identities[k] != v}
            if clash:
                raise DuplicateOp(
                    f"torch op {name} is registered with kernels {identities} in this process; "
                    f"plugin {definition.source} brings {wanted}. A process runs one "
                    f"implementation of an op: restart it to switch plugin versions",
                    op=definition.name)
            fresh = [(k, kern) for k, kern in kernels if k not in identities]
            library = torch.library.Library(namespace, "FRAGMENT")
            for key, kernel in fresh:
                library.impl(op_type, kernel.function, key)
                identities[key] = wanted[key]
            libraries.append(library)
            return name
        library = torch.library.Library(namespace, "FRAGMENT")
        library.define(torch_schema(definition))
        torch.library.register_fake(name, fake_from_shape_function(definition), lib=library)
        for key, kernel in kernels:
            library.impl(op_type, kernel.function, key)
        _registered[name] = (dict(wanted), [library])
    logger.info("registered torch op %s (%s) for %s", name, definition.source, sorted(wanted))
    return name

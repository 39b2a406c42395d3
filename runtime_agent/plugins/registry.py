"""The op registry: ``domain::OpType`` → its device-free definition, and its kernels per
(backend, device), registered apart (``torch.library``'s ``custom_op`` / ``register_fake`` /
``register_kernel`` split).

The compiler needs only definitions (signature, attributes, shape function); a runtime needs
the kernel for its own backend and device. ``register`` and ``register_kernel`` raise on a
duplicate, never keep the first silently; ``get`` and ``kernel`` raise our errors listing
what is registered.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime_agent.plugins.errors import (
    DuplicateOp,
    NoImplementation,
    ShapeFunctionError,
    UnknownOp,
)
from runtime_agent.plugins.types import Kernel, ShapeFunction, TensorType
from schemas.plugins import OpSpec

logger = logging.getLogger(__name__)

__all__ = ["NativeLibrary", "OpDefinition", "OpRegistry", "PythonKernel", "split_op"]


def split_op(name: str) -> tuple[str, str]:
    """``"domain::OpType"`` → ``("domain", "OpType")``; the default domain is ``ai.onnx``."""
    domain, sep, op_type = name.rpartition("::")
    if not sep or not domain or not op_type:
        raise UnknownOp(f"op names are written domain::OpType; got {name!r}", op=name)
    return domain, op_type


@dataclass(frozen=True)
class PythonKernel:
    """A Python implementation of one op on one (backend, device)."""

    op: str
    backend: str
    device: str
    function: Kernel
    #: ``module:function`` in its bundle (or the function's qualified name).
    entry: str
    #: Digest of what the kernel is (its op, entry and module sources): two registrations of
    #: the same identity are the same kernel.
    identity: str = ""
    #: sha256 of the plugin bundle it came from (empty outside a bundle).
    plugin_digest: str = ""
    #: ``name version`` of the plugin it came from, for messages.
    source: str = ""

    kind = "python"


@dataclass(frozen=True)
class NativeLibrary:
    """A shared library implementing ``ops`` on one (backend, device), built for ``abi``."""

    ops: tuple[str, ...]
    backend: str
    device: str
    path: Path
    abi: str
    #: The library's path inside its bundle.
    entry: str
    #: sha256 of the plugin bundle it came from.
    plugin_digest: str = ""
    source: str = ""

    kind = "native"


Implementation = PythonKernel | NativeLibrary


@dataclass
class OpDefinition:
    """The device-free half of an op: its spec (signature, attributes) and shape function."""

    spec: OpSpec
    shape_function: ShapeFunction | None = None
    #: ``name version`` (or module) it came from, for messages.
    source: str = ""
    kernels: dict[tuple[str, str], Implementation] = field(default_factory=dict)
    #: ``backend/device`` of every implementation its plugin declares (loaded or not).
    declared_targets: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.spec.qualified_name

    def targets(self) -> list[str]:
        """``backend/device`` of every kernel registered or declared, sorted."""
        return sorted({f"{b}/{d}" for b, d in self.kernels} | set(self.declared_targets))

    def infer(self, input_types: Sequence[TensorType | None],
              attributes: Mapping[str, Any]) -> list[TensorType]:
        """Output types from the shape function, checked (count, dtypes the op allows, rank
        of the declared outputs). Whatever the function raises, and a result that is not the
        outputs' types, becomes ``ShapeFunctionError`` naming the op."""
        if self.shape_function is None:
            raise ShapeFunctionError(
                f"op {self.name} has no shape function; its outputs' types are unknown",
                op=self.name,
            )
        try:
            result = self.shape_function(list(input_types), dict(attributes))
        except Exception as exc:  # user code: anything it raises is reported, typed
            raise ShapeFunctionError(
                f"the shape function of op {self.name} ({self.source or 'unknown source'}) "
                f"raised {type(exc).__name__}: {exc} (input types "
                f"{[str(t) for t in input_types]}, attributes {dict(attributes)})",
                op=self.name, error=f"{type(exc).__name__}: {exc}",
            ) from exc
        outputs = [result] if isinstance(result, TensorType) else list(result or [])
        expected = self.spec.outputs
        if len(outputs) != len(expected) or not all(isinstance(t, TensorType) for t in outputs):
            raise ShapeFunctionError(
                f"the shape function of op {self.name} returned {result!r}; expected "
                f"{len(expected)} TensorType(s), one per output {[a.name for a in expected]}",
                op=self.name,
            )
        for arg, out in zip(expected, outputs, strict=True):
            if out.dtype not in arg.dtypes:
                raise ShapeFunctionError(
                    f"the shape function of op {self.name} gave output {arg.name!r} dtype "
                    f"{out.dtype}; the op declares {arg.dtypes}", op=self.name,
                )
        return outputs


class OpRegistry:
    """``domain::OpType`` → ``OpDefinition``, with kernels per (backend, device)."""

    def __init__(self, definitions: Iterable[OpDefinition] = ()) -> None:
        self._ops: dict[str, OpDefinition] = {}
        self._lock = threading.RLock()
        for definition in definitions:
            self.add(definition)

    def register(self, spec: OpSpec, shape_function: ShapeFunction | None = None, *,
                 source: str = "") -> OpDefinition:
        """Register op ``spec.qualified_name``; a name registered before raises ``DuplicateOp``."""
        return self.add(OpDefinition(spec, shape_function, source))

    def add(self, definition: OpDefinition) -> OpDefinition:
        with self._lock:
            existing = self._ops.get(definition.name)
            if existing is not None:
                raise DuplicateOp(
                    f"op {definition.name} is already registered (from "
                    f"{existing.source or 'unknown'}); refusing a second registration from "
                    f"{definition.source or 'unknown'}",
                    op=definition.name, registered=existing.source, refused=definition.source,
                )
            self._ops[definition.name] = definition
        return definition

    def register_kernel(self, implementation: Implementation, op: str | None = None) -> None:
        """Register a kernel (Python or native) of ``op`` for its (backend, device); a second
        kernel for the same op and target raises ``DuplicateOp``."""
        names = [op] if op is not None else (
            [implementation.op] if isinstance(implementation, PythonKernel)
            else list(implementation.ops))
        with self._lock:
            for name in names:
                definition = self.get(name)
                key = (implementation.backend, implementation.device)
                if key in definition.kernels:
                    raise DuplicateOp(
                        f"op {name} already has a kernel for {key[0]}/{key[1]} "
                        f"({definition.kernels[key].entry}); refusing {implementation.entry}",
                        op=name, backend=key[0], device=key[1],
                    )
            for name in names:
                self._ops[name].kernels[(implementation.backend, implementation.device)] = (
                    implementation)

    def get(self, op: str) -> OpDefinition:
        """The definition of ``op``; ``UnknownOp`` lists the registered ops."""
        try:
            return self._ops[op]
        except KeyError:
            raise UnknownOp(
                f"Could not find a registered custom op: {op!r}. Currently registered ops "
                f"are: {self.ops() or 'none'}", op=op, registered=self.ops(),
            ) from None

    def kernel(self, op: str, backend: str, device: str) -> Implementation:
        """The kernel of ``op`` for ``backend``/``device``; ``NoImplementation`` lists the
        targets the op has."""
        definition = self.get(op)
        try:
            return definition.kernels[(backend, device)]
        except KeyError:
            raise NoImplementation(
                f"op {op} has no implementation for backend {backend!r} on device "
                f"{device!r}; it has implementations for {definition.targets() or 'none'}"
                f"{f' (plugin {definition.source})' if definition.source else ''}",
                op=op, backend=backend, device=device, available=definition.targets(),
            ) from None

    def ops(self) -> list[str]:
        with self._lock:
            return sorted(self._ops)

    def domains(self) -> list[str]:
        return sorted({split_op(name)[0] for name in self.ops()})

    def __contains__(self, op: object) -> bool:
        return op in self._ops

    def __len__(self) -> int:
        return len(self._ops)

    def definitions(self) -> list[OpDefinition]:
        with self._lock:
            return [self._ops[name] for name in sorted(self._ops)]

    @classmethod
    def union(cls, registries: Iterable[OpRegistry]) -> OpRegistry:
        """One registry holding the ops of all ``registries``; an op declared by two raises
        ``DuplicateOp`` naming both sources."""
        merged = cls()
        for registry in registries:
            for definition in registry.definitions():
                merged.add(definition)
        return merged

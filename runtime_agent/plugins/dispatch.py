"""Calling a Python kernel: inputs in, outputs pre-allocated from the shape function, kernel
called with its context, outputs out. Shared by every runtime adapter and by local tests
(``kiln.ops``), so a kernel sees the same thing wherever it runs.

A runtime calls the same op many times, so ``KernelCall`` prepares what does not change
between calls (the accepted dtypes, the logger, a scratch pool) and remembers the last
attribute sets it resolved and the output types the shape function gave per input types and
attributes — shape functions are pure functions of types and attributes, so a repeated call
does not run one again.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from runtime_agent.plugins.errors import NoImplementation, ShapeFunctionError
from runtime_agent.plugins.registry import OpDefinition, PythonKernel
from runtime_agent.plugins.types import (
    Kernel,
    KernelContext,
    ScratchAllocator,
    TensorView,
    dtype_name,
    resolve_attributes,
)
from schemas.errors import InvalidRequest

__all__ = ["KernelCall", "as_view", "invoke_kernel", "numpy_dtype"]

#: Entries each cache of a ``KernelCall`` keeps before it starts over.
CACHE_ENTRIES = 64


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a Kiln dtype name (``"string"`` is numpy ``object``)."""
    return np.dtype(object) if name == "string" else np.dtype(name)


def as_view(tensor: Any) -> TensorView:
    """A ``TensorView`` of a numpy array (directly) or any DLPack tensor (``from_dlpack``)."""
    if isinstance(tensor, TensorView):
        return tensor
    if isinstance(tensor, np.ndarray):
        return TensorView.from_numpy(tensor)
    return TensorView.from_dlpack(tensor)


def _key(attributes: Mapping[str, Any]) -> tuple | None:
    try:
        key = tuple(sorted(attributes.items()))
        hash(key)
    except TypeError:  # list-valued attributes: not cached
        return None
    return key


class KernelCall:
    """One op's kernel, ready to be called repeatedly (``call(inputs, attributes)``)."""

    def __init__(self, definition: OpDefinition, kernel: PythonKernel | Kernel, *,
                 logger: logging.Logger | None = None,
                 scratch: ScratchAllocator | None = None) -> None:
        self.definition = definition
        self.function = kernel.function if isinstance(kernel, PythonKernel) else kernel
        self.name = definition.name
        self.args = definition.spec.inputs
        self.accepted = [frozenset(numpy_dtype(d) for d in arg.dtypes) for arg in self.args]
        self.logger = logger or logging.getLogger(f"kiln.ops.{definition.name}")
        self.scratch = scratch if scratch is not None else ScratchAllocator()
        self._attributes: dict[tuple, dict[str, Any]] = {}
        self._outputs: dict[tuple, list[tuple[tuple[int, ...], np.dtype]]] = {}

    def _views(self, inputs: Sequence[Any]) -> list[TensorView | None]:
        if len(inputs) > len(self.args):
            raise InvalidRequest(f"op {self.name} takes {len(self.args)} input(s) "
                                 f"{[a.name for a in self.args]}; given {len(inputs)}")
        views: list[TensorView | None] = []
        for index, arg in enumerate(self.args):
            tensor = inputs[index] if index < len(inputs) else None
            if tensor is None:
                if not arg.optional:
                    raise InvalidRequest(f"op {self.name}: input {arg.name!r} is required")
                views.append(None)
                continue
            view = (TensorView.from_numpy(tensor) if type(tensor) is np.ndarray
                    else as_view(tensor))
            if view.dtype not in self.accepted[index]:
                raise InvalidRequest(
                    f"op {self.name}: input {arg.name!r} has dtype {dtype_name(view.dtype)}; "
                    f"the op takes {arg.dtypes}", op=self.name, input=arg.name,
                )
            views.append(view)
        return views

    def _resolve(self, attributes: Mapping[str, Any]) -> tuple[dict[str, Any], tuple | None]:
        key = _key(attributes)
        if key is not None:
            cached = self._attributes.get(key)
            if cached is not None:
                return dict(cached), key
        values = resolve_attributes(self.definition.spec, attributes)
        if key is not None:
            if len(self._attributes) >= CACHE_ENTRIES:
                self._attributes.clear()
            self._attributes[key] = values
        return dict(values), key

    def _output_types(self, views: list[TensorView | None], values: dict[str, Any],
                      key: tuple | None) -> list[tuple[tuple[int, ...], np.dtype]]:
        signature = tuple((v.dtype, v.shape) if v is not None else None for v in views)
        cache_key = (signature, key) if key is not None else None
        if cache_key is not None:
            cached = self._outputs.get(cache_key)
            if cached is not None:
                return cached
        types = self.definition.infer([v.type if v is not None else None for v in views],
                                      values)
        outputs = []
        for arg, out in zip(self.definition.spec.outputs, types, strict=True):
            if not out.concrete:
                raise ShapeFunctionError(
                    f"the shape function of op {self.name} gave output {arg.name!r} the shape "
                    f"{out.shape} for concrete inputs; a kernel's outputs need every dimension "
                    f"known", op=self.name,
                )
            outputs.append((out.shape, numpy_dtype(out.dtype)))
        if cache_key is not None:
            if len(self._outputs) >= CACHE_ENTRIES:
                self._outputs.clear()
            self._outputs[cache_key] = outputs
        return outputs

    def __call__(self, inputs: Sequence[Any], attributes: Mapping[str, Any], *,
                 stream: Any = None) -> list[np.ndarray]:
        views = self._views(inputs)
        values, key = self._resolve(attributes)
        devices = {v.device for v in views if v is not None}
        device = devices.pop() if len(devices) == 1 else "cpu"
        if devices:
            raise InvalidRequest(f"op {self.name}: inputs on several devices")
        if device != "cpu":
            raise NoImplementation(
                f"op {self.name}: Kiln allocates Python kernels' outputs on the CPU; inputs on "
                f"{device} need a device allocator, which this runtime does not have",
                op=self.name, device=device,
            )
        outputs = [np.empty(shape, dtype=dtype)
                   for shape, dtype in self._output_types(views, values, key)]
        context = KernelContext(self.name, device, stream, self.scratch, self.logger)
        try:
            returned = self.function(context, views,
                                     [TensorView.from_numpy(o) for o in outputs], values)
        finally:
            self.scratch.release()
        if returned is not None:
            raise InvalidRequest(
                f"the kernel of op {self.name} returned {type(returned).__name__}; a kernel "
                f"writes into its pre-allocated outputs and returns None", op=self.name,
            )
        return outputs


def invoke_kernel(
    definition: OpDefinition,
    kernel: PythonKernel | Kernel,
    inputs: Sequence[Any],
    attributes: Mapping[str, Any],
    *,
    scratch: ScratchAllocator | None = None,
    logger: logging.Logger | None = None,
    stream: Any = None,
) -> list[np.ndarray]:
    """Run ``kernel`` of op ``definition`` once on ``inputs`` (numpy arrays or DLPack tensors;
    ``None`` for an absent optional input) and return its outputs.

    Attributes are checked and completed with their defaults; input dtypes are checked against
    the op's signature; outputs are allocated with the types the shape function gives for the
    concrete inputs. The kernel writes them and returns ``None``.
    """
    call = KernelCall(definition, kernel, logger=logger, scratch=scratch)
    return call(inputs, attributes, stream=stream)

"""What a custom op's code sees: tensor types (shape functions), tensor views and the kernel
context (kernels), and attribute values with their defaults.

A *shape function* is device-free: ``shape_fn(input_types, attributes) -> output_types``, with
one ``TensorType`` per input (``None`` for an absent optional input) and one per output. The
compiler calls it with symbolic shapes (a dimension is an ``int``, a ``str`` naming a dynamic
axis, or ``None`` when unknown; ``shape=None`` means unknown rank); a runtime calls it with
concrete shapes to pre-allocate a kernel's outputs.

A *Python kernel* is ``kernel(ctx, inputs, outputs, attributes) -> None``: ``inputs`` and
``outputs`` are ``TensorView`` sequences, the outputs already allocated with the shapes and
dtypes the shape function gave; the kernel writes them in place. ``attributes`` has every
attribute the op declares, defaults applied.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from schemas.errors import InvalidRequest
from schemas.plugins import AttributeSpec, OpSpec

__all__ = [
    "DLPACK_DEVICES",
    "Kernel",
    "KernelContext",
    "ScratchAllocator",
    "ShapeFunction",
    "TensorType",
    "TensorView",
    "dtype_name",
    "resolve_attributes",
]

Dim = int | str | None


@dataclass(frozen=True)
class TensorType:
    """A tensor's element type (a numpy dtype name) and shape (``None``: unknown rank)."""

    dtype: str
    shape: tuple[Dim, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", _dtype_name(self.dtype))
        if self.shape is not None:
            object.__setattr__(self, "shape", tuple(self.shape))
            for dim in self.shape:
                if not (dim is None or isinstance(dim, str)
                        or (isinstance(dim, int | np.integer) and not isinstance(dim, bool)
                            and int(dim) >= 0)):
                    raise InvalidRequest(
                        f"a dimension is a non-negative int, a str naming a dynamic axis, or "
                        f"None; got {dim!r} in shape {self.shape}"
                    )
            object.__setattr__(self, "shape", tuple(
                int(d) if isinstance(d, int | np.integer) else d for d in self.shape))

    @classmethod
    def concrete_of(cls, dtype: np.dtype, shape: tuple[int, ...]) -> TensorType:
        """The type of an existing tensor (no validation: numpy already guarantees it)."""
        instance = object.__new__(cls)
        object.__setattr__(instance, "dtype", dtype_name(dtype))
        object.__setattr__(instance, "shape", shape)
        return instance

    @property
    def rank(self) -> int | None:
        return None if self.shape is None else len(self.shape)

    @property
    def concrete(self) -> bool:
        """Whether every dimension is a known int (what allocation needs)."""
        return self.shape is not None and all(isinstance(d, int) for d in self.shape)

    def __str__(self) -> str:
        dims = "[...]" if self.shape is None else f"[{', '.join(map(str, self.shape))}]"
        return f"{self.dtype}{dims}"


_STRING_NAMES = {"string", "str", "object"}
_NAMES: dict[np.dtype, str] = {}


def dtype_name(dtype: np.dtype) -> str:
    """Kiln's name of a numpy dtype (``float32``, ``string`` for object), cached (numpy
    computes ``dtype.name`` in Python on every access)."""
    try:
        return _NAMES[dtype]
    except KeyError:
        name = _dtype_name(dtype)
        _NAMES[dtype] = name
        return name


def _dtype_name(dtype: object) -> str:
    if isinstance(dtype, str) and dtype in _STRING_NAMES:
        return "string"
    try:
        name = np.dtype(dtype).name  # type: ignore[call-overload]
    except TypeError as exc:
        raise InvalidRequest(f"{dtype!r} is not a numpy dtype") from exc
    return "string" if name in _STRING_NAMES or name.startswith("str") else name


#: DLPack device types (``__dlpack_device__()[0]``) → Kiln device names.
DLPACK_DEVICES = {1: "cpu", 2: "cuda", 3: "cpu", 4: "opencl", 7: "vulkan", 8: "metal",
                  10: "rocm", 13: "cuda", 14: "oneapi"}


class TensorView:
    """One tensor handed to a kernel: ``dtype``, ``shape``, ``strides`` (in elements, as in
    DLPack), ``device`` (``"cpu"``, ``"cuda:0"``, ...).

    On the CPU ``numpy()`` is the array itself (zero copy; an output's array is written in
    place). Any view can be passed on through DLPack (``torch.from_dlpack(view)``): a view
    made by ``from_dlpack`` hands its producer's capsule through unchanged, so device memory
    never takes a detour through the host.
    """

    __slots__ = ("_array", "_source", "device", "dtype", "shape", "strides")

    def __init__(self, *, dtype: np.dtype, shape: tuple[int, ...], strides: tuple[int, ...],
                 device: str, array: np.ndarray | None = None, source: Any = None) -> None:
        self.dtype = dtype
        self.shape = shape
        self.strides = strides
        self.device = device
        self._array = array
        self._source = source

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> TensorView:
        """A CPU view of ``array`` (no copy)."""
        view = object.__new__(cls)
        view.dtype = array.dtype
        view.shape = array.shape
        itemsize = array.itemsize or 1
        view.strides = tuple([s // itemsize for s in array.strides])
        view.device = "cpu"
        view._array = array
        view._source = None
        return view

    @classmethod
    def from_dlpack(cls, tensor: Any) -> TensorView:
        """A view of any object with ``__dlpack__`` / ``__dlpack_device__`` (a numpy array, a
        torch or cupy tensor). On the CPU the memory is read through ``numpy.from_dlpack``
        (no copy); on another device dtype, shape and strides come from the tensor's own
        attributes and the capsule is passed on untouched by ``__dlpack__``."""
        if not hasattr(tensor, "__dlpack_device__"):
            raise InvalidRequest(
                f"{type(tensor).__name__} does not support DLPack (no __dlpack_device__)")
        device_type, device_id = tensor.__dlpack_device__()
        kind = DLPACK_DEVICES.get(int(device_type), f"dlpack-device-{int(device_type)}")
        if kind == "cpu":
            array = np.from_dlpack(tensor)
            view = cls.from_numpy(array)
            view._source = tensor
            return view
        shape = tuple(int(d) for d in tensor.shape)
        if callable(getattr(tensor, "stride", None)):  # torch
            strides = tuple(int(s) for s in tensor.stride())
        else:  # cupy and other numpy-like arrays give byte strides
            itemsize = int(getattr(tensor, "itemsize", 0) or np.dtype(str(tensor.dtype)).itemsize)
            strides = tuple(int(s) // itemsize for s in tensor.strides)
        dtype = np.dtype(str(tensor.dtype).removeprefix("torch."))
        return cls(dtype=dtype, shape=shape, strides=strides, device=f"{kind}:{int(device_id)}",
                   source=tensor)

    def numpy(self) -> np.ndarray:
        """The tensor as a numpy array (CPU tensors only; no copy)."""
        if self._array is None:
            raise InvalidRequest(
                f"a tensor on {self.device} has no numpy() view; pass it on through DLPack "
                f"(e.g. torch.from_dlpack(view)) or copy it to the host yourself"
            )
        return self._array

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        source = self._source if self._source is not None else self._array
        return source.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        if self._source is not None:
            return self._source.__dlpack_device__()
        return (1, 0)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def type(self) -> TensorType:
        return TensorType.concrete_of(self.dtype, self.shape)

    def __repr__(self) -> str:
        return (f"TensorView({self.dtype.name}{list(self.shape)}, strides={list(self.strides)}, "
                f"device={self.device!r})")


class ScratchAllocator:
    """Temporary numpy buffers for one kernel call, reused across calls of the same op.

    ``allocate(shape, dtype)`` returns an uninitialized buffer that is valid until the kernel
    returns; afterwards it goes back to a per-thread pool and may be handed out again, so a
    kernel must not keep a reference to it.
    """

    def __init__(self) -> None:
        self._local = threading.local()
        self.peak_bytes = 0

    def _state(self) -> Any:
        local = self._local
        if not hasattr(local, "free"):
            local.free, local.used, local.bytes = {}, [], 0
        return local

    def allocate(self, shape: Sequence[int], dtype: Any = np.float32) -> np.ndarray:
        local = self._state()
        key = (tuple(shape), dtype if isinstance(dtype, np.dtype) else np.dtype(dtype))
        pool = local.free.get(key)
        buffer = pool.pop() if pool else np.empty(key[0], dtype=key[1])
        local.used.append((key, buffer))
        local.bytes += buffer.nbytes
        if local.bytes > self.peak_bytes:
            self.peak_bytes = local.bytes
        return buffer

    def release(self) -> None:
        """Return every buffer handed out on this thread to the pool (after a call)."""
        local = self._state()
        for key, buffer in local.used:
            local.free.setdefault(key, []).append(buffer)
        local.used.clear()
        local.bytes = 0


@dataclass
class KernelContext:
    """What a kernel gets besides its tensors: where it runs, and runtime services."""

    #: ``domain::OpType`` of the op being run.
    op: str
    #: ``"cpu"``, or e.g. ``"cuda:0"``.
    device: str = "cpu"
    #: The stream to enqueue work on (a CUDA stream handle); ``None`` on the CPU.
    stream: Any = None
    scratch: ScratchAllocator = field(default_factory=ScratchAllocator)
    logger: logging.Logger = field(default_factory=lambda: logging.getLogger("kiln.ops"))

    def allocate(self, shape: Sequence[int], dtype: Any = np.float32) -> np.ndarray:
        """A scratch buffer valid for this call (``scratch.allocate``)."""
        return self.scratch.allocate(shape, dtype)


ShapeFunction = Callable[[list[TensorType | None], dict[str, Any]], Sequence[TensorType]]
Kernel = Callable[[KernelContext, Sequence[TensorView], Sequence[TensorView], dict[str, Any]],
                  None]


def _coerce(spec: AttributeSpec, value: Any) -> Any:
    if isinstance(value, bytes):
        value = value.decode()
    if spec.type == "int":
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise TypeError
        return int(value)
    if spec.type == "float":
        if isinstance(value, bool) or not isinstance(value, int | float | np.number):
            raise TypeError
        return float(value)
    if spec.type == "string":
        if not isinstance(value, str):
            raise TypeError
        return value
    if not isinstance(value, list | tuple | np.ndarray):
        raise TypeError
    item = AttributeSpec(name=spec.name, type="int" if spec.type == "ints" else "float")
    return [_coerce(item, v) for v in value]


def resolve_attributes(spec: OpSpec, given: Mapping[str, Any]) -> dict[str, Any]:
    """``given`` checked against ``spec.attributes`` (names, types) with defaults filled in.

    An attribute the op does not declare, a required one missing, or a value of the wrong type
    raises ``InvalidRequest`` naming the op and what it declares. An optional attribute with
    no default stays absent unless given.
    """
    declared = {a.name: a for a in spec.attributes}
    unknown = sorted(set(given) - set(declared))
    if unknown:
        raise InvalidRequest(
            f"op {spec.qualified_name} has no attribute(s) {unknown}; it declares "
            f"{[f'{a.name}: {a.type}' for a in spec.attributes] or 'none'}",
            op=spec.qualified_name, unknown=unknown,
        )
    values: dict[str, Any] = {}
    for name, attribute in declared.items():
        if name in given:
            value = given[name]
        elif attribute.default is not None:
            value = attribute.default
        elif attribute.required:
            raise InvalidRequest(
                f"op {spec.qualified_name} requires attribute {name!r} ({attribute.type}), "
                f"which is missing", op=spec.qualified_name, attribute=name,
            )
        else:
            continue
        try:
            values[name] = _coerce(attribute, value)
        except (TypeError, ValueError):
            raise InvalidRequest(
                f"attribute {name!r} of op {spec.qualified_name} is {attribute.type}; got "
                f"{value!r}", op=spec.qualified_name, attribute=name,
            ) from None
    return values

"""Tensors crossing into an executor: numpy arrays and DLPack producers, checked against the
signature once, and output shapes known before a run.

An input is a numpy array or any object with ``__dlpack__`` (a torch tensor, a CuPy array, a
JAX array). A host tensor becomes a numpy view of the same memory (``np.from_dlpack``: no
copy); a non-contiguous one is copied once into a contiguous array, with a debug log line. A
tensor on a device the engine does not run on is refused with a message naming both devices —
never moved behind the caller's back. For an engine on CUDA, a CUDA tensor stays where it is
and is described by ``DeviceTensor`` (its ``__cuda_array_interface__``: pointer, dtype, shape),
so the executor can bind its memory directly.

``OutputShapes`` resolves each output's shape from the manifest's signature: fixed dimensions
as they are, a named dynamic dimension from the input that carries the same name (ONNX gives
one ``dim_param`` one size across a graph). An output with a dimension no input names cannot
be known before the run; the executor lets its runtime allocate that one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime_agent.samples import numpy_dtype
from schemas.errors import InvalidRequest
from schemas.manifest import TensorSpec

logger = logging.getLogger(__name__)

#: DLPack device types (``DLDeviceType``) by number, for messages.
DLPACK_DEVICES = {1: "cpu", 2: "cuda", 3: "cuda_host", 4: "opencl", 7: "vulkan", 8: "metal",
                  9: "vpi", 10: "rocm", 11: "rocm_host", 13: "cuda_managed", 14: "oneapi"}
#: Device types whose memory the host reads directly.
HOST_DEVICES = (1, 3, 11)
KDL_CUDA = 2


@dataclass(frozen=True)
class DeviceTensor:
    """A CUDA tensor handed to an engine on CUDA: its memory, left where it is."""

    owner: Any
    dtype: np.dtype
    shape: tuple[int, ...]
    pointer: int
    device_id: int

    @property
    def ndim(self) -> int:
        return len(self.shape)


def describe(spec: TensorSpec) -> str:
    return f"{spec.name}: {spec.dtype}{list(spec.shape)}"


def _device_tensor(name: str, value: Any, device_id: int, kind: str) -> DeviceTensor:
    interface = getattr(value, "__cuda_array_interface__", None)
    if interface is None:
        raise InvalidRequest(
            f"{kind} {name!r} is a CUDA tensor of type {type(value).__name__} without "
            f"__cuda_array_interface__; expected a torch tensor or CuPy array on CUDA")
    shape = tuple(int(d) for d in interface["shape"])
    dtype = np.dtype(interface["typestr"])
    strides = interface.get("strides")
    if strides is not None and tuple(strides) != _c_strides(shape, dtype.itemsize):
        raise InvalidRequest(
            f"{kind} {name!r} is a non-contiguous CUDA tensor (strides {list(strides)}, shape "
            f"{list(shape)}); the engine reads dense row-major memory: pass "
            f"tensor.contiguous()")
    return DeviceTensor(value, dtype, shape, int(interface["data"][0]), device_id)


#: torch dtype → numpy dtype, learned as tensors arrive (bfloat16 has none: ``None``).
_TORCH_DTYPES: dict[Any, np.dtype | None] = {}


def _torch_cuda_tensor(value: Any) -> DeviceTensor | None:
    """A dense CUDA torch tensor without a gradient described straight from its attributes:
    the same pointer, dtype and shape its ``__cuda_array_interface__`` gives, without that
    property's Python cost (tens of microseconds a call on a small model's budget). ``None``
    for anything else, which takes the general path (and its refusals)."""
    if type(value).__name__ not in ("Tensor", "Parameter") or not getattr(value, "is_cuda", False):
        return None
    if value.requires_grad or not value.is_contiguous():
        return None
    dtype = _TORCH_DTYPES.get(value.dtype, False)
    if dtype is False:
        try:
            dtype = np.dtype(str(value.dtype).removeprefix("torch."))
        except TypeError:
            dtype = None
        _TORCH_DTYPES[value.dtype] = dtype
    if dtype is None:
        return None
    return DeviceTensor(value, dtype, tuple(value.shape), value.data_ptr(), value.get_device())


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides, step = [], itemsize
    for dim in reversed(shape):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))


def from_dlpack(name: str, value: Any, *, device: str, kind: str = "input",
                device_memory: bool = True) -> np.ndarray | DeviceTensor:
    """``value`` (not a numpy array) as a numpy view of its memory, or a ``DeviceTensor`` when
    the engine runs on CUDA, so does the tensor, and the executor binds device memory
    (``device_memory``); ``InvalidRequest`` otherwise."""
    if device == "cuda" and device_memory:
        fast = _torch_cuda_tensor(value)
        if fast is not None:
            return fast
    if not hasattr(value, "__dlpack__") or not hasattr(value, "__dlpack_device__"):
        raise InvalidRequest(
            f"{kind} {name!r}: expected a numpy array or a DLPack tensor (an object with "
            f"__dlpack__, such as a torch tensor); given {type(value).__name__}")
    device_type, device_id = (int(v) for v in value.__dlpack_device__())
    where = f"{DLPACK_DEVICES.get(device_type, f'device type {device_type}')}:{device_id}"
    if device_type == KDL_CUDA and device == "cuda":
        if not device_memory:
            raise InvalidRequest(
                f"{kind} {name!r} is on {where}; this executor takes host arrays even for an "
                f"engine on CUDA: pass tensor.cpu()")
        return _device_tensor(name, value, device_id, kind)
    if device_type not in HOST_DEVICES:
        raise InvalidRequest(
            f"{kind} {name!r} is on {where}; this engine runs on {device} and reads "
            f"{'host' if device == 'cpu' else device} memory: move the tensor there first "
            f"(for torch: tensor.cpu())")
    try:
        return np.from_dlpack(value)
    except (BufferError, RuntimeError, TypeError, ValueError) as exc:
        raise InvalidRequest(
            f"{kind} {name!r} ({type(value).__name__} on {where}) could not be read through "
            f"DLPack: {exc}") from exc


class InputCheck:
    """The signature's input checks, compiled once: names, dtypes, ranks, fixed dimensions."""

    def __init__(self, specs: Sequence[TensorSpec], device: str = "cpu",
                 device_memory: bool = False) -> None:
        self.specs = {spec.name: spec for spec in specs}
        self.device = device
        self.device_memory = device_memory
        self._checks = [
            (spec.name, numpy_dtype(spec.dtype),
             None if list(spec.shape) == ["..."] else len(spec.shape),
             tuple((axis, dim) for axis, dim in enumerate(spec.shape) if isinstance(dim, int)))
            for spec in specs
        ]

    def __call__(self, inputs: Mapping[str, Any]) -> dict[str, np.ndarray | DeviceTensor]:
        """The feed, each value a contiguous numpy array (or a ``DeviceTensor``), checked; the
        first mismatch raises ``InvalidRequest`` saying what was expected."""
        if len(inputs) != len(self._checks):
            self.refuse(inputs)
        feed: dict[str, np.ndarray | DeviceTensor] = {}
        for name, dtype, rank, fixed in self._checks:
            value = inputs.get(name)
            if type(value) is not np.ndarray:
                if value is None:
                    self.refuse(inputs)
                value = (value if isinstance(value, np.ndarray)
                         else from_dlpack(name, value, device=self.device,
                                          device_memory=self.device_memory))
            if value.dtype != dtype or (rank is not None and value.ndim != rank):
                self.refuse({**inputs, name: value})
            shape = value.shape
            for axis, want in fixed:
                if shape[axis] != want:
                    self.refuse({**inputs, name: value})
            if type(value) is np.ndarray and not value.flags.c_contiguous:
                logger.debug("input %r: copying a non-contiguous array of shape %s (strides %s) "
                             "into contiguous memory", name, list(shape), list(value.strides))
                value = np.ascontiguousarray(value)
            feed[name] = value
        return feed

    def refuse(self, inputs: Mapping[str, Any]) -> None:
        """Raise ``InvalidRequest`` for the first way ``inputs`` differ from the signature."""
        specs = self.specs
        missing = [name for name in specs if name not in inputs]
        unexpected = [name for name in inputs if name not in specs]
        if missing or unexpected:
            expected = ", ".join(describe(s) for s in specs.values())
            raise InvalidRequest(
                f"expected inputs [{expected}]; given {sorted(inputs)} "
                f"(missing {missing}, unexpected {unexpected})",
                missing=missing, unexpected=unexpected)
        for name, spec in specs.items():
            value = inputs[name]
            if not isinstance(value, np.ndarray | DeviceTensor):
                value = from_dlpack(name, value, device=self.device,
                                    device_memory=self.device_memory)
            if value.dtype.name != spec.dtype:
                raise InvalidRequest(
                    f"input {name!r}: expected dtype {spec.dtype} ({describe(spec)}); given "
                    f"{value.dtype}")
            if list(spec.shape) == ["..."]:
                continue
            if value.ndim != len(spec.shape):
                raise InvalidRequest(
                    f"input {name!r}: expected rank {len(spec.shape)} ({describe(spec)}); "
                    f"given shape {list(value.shape)}")
            for axis, (want, got) in enumerate(zip(spec.shape, value.shape, strict=True)):
                if isinstance(want, int) and want != got:
                    raise InvalidRequest(
                        f"input {name!r}: expected dimension {axis} to be {want} "
                        f"({describe(spec)}); given shape {list(value.shape)}")
        raise InvalidRequest(f"inputs {sorted(inputs)} do not match the signature "
                             f"[{', '.join(describe(s) for s in specs.values())}]")


#: One output dimension: a fixed size, or (input name, axis) it is read from.
Dim = int | tuple[str, int]


class OutputShapes:
    """Each output's shape before the run, from the signature and the inputs' shapes."""

    def __init__(self, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> None:
        symbols: dict[str, tuple[str, int]] = {}
        for spec in inputs:
            if list(spec.shape) == ["..."]:
                continue
            for axis, dim in enumerate(spec.shape):
                if isinstance(dim, str):
                    symbols.setdefault(dim, (spec.name, axis))
        self.dtypes = {spec.name: numpy_dtype(spec.dtype) for spec in outputs}
        #: Output name → its dimensions, or ``None`` when one cannot be known before the run.
        self.plans: dict[str, tuple[Dim, ...] | None] = {}
        #: Output name → why its shape cannot be known before the run.
        self.unknown: dict[str, str] = {}
        for spec in outputs:
            if list(spec.shape) == ["..."]:
                self.plans[spec.name] = None
                self.unknown[spec.name] = "the signature does not fix its rank"
                continue
            dims: list[Dim] = []
            for dim in spec.shape:
                if isinstance(dim, int):
                    dims.append(dim)
                elif dim in symbols:
                    dims.append(symbols[dim])
                else:
                    self.unknown[spec.name] = (f"dimension {dim!r} is not a dimension of any "
                                               f"input")
                    break
            self.plans[spec.name] = None if spec.name in self.unknown else tuple(dims)

    @property
    def static(self) -> bool:
        """Whether every output's shape is known before the run."""
        return not self.unknown

    def shape(self, name: str, feed: Mapping[str, Any]) -> tuple[int, ...] | None:
        plan = self.plans[name]
        if plan is None:
            return None
        return tuple(d if type(d) is int else feed[d[0]].shape[d[1]] for d in plan)  # type: ignore[index]

    def symbolic(self, name: str) -> tuple[Dim, ...] | None:
        return self.plans[name]

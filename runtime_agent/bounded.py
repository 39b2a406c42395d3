"""Bounded decoding of inference requests: nothing a request declares is allocated before it is
checked.

- JSON: a size cap, then a nesting-depth limit measured on the raw bytes (string contents
  skipped) before ``json.loads`` builds a single object; a body too deep, too large or not
  JSON is an ``InvalidRequest`` / ``PayloadTooLarge``, never a ``RecursionError``.
- npz: every member's ``.npy`` header is read (``numpy.lib.format``, a few hundred bytes
  each, no data) and its dtype and shape checked against the model's signature and the byte
  cap before any array is loaded.

Callers run these in a worker thread: they are CPU work, never on the event loop.
"""

from __future__ import annotations

import io
import json
import math
import re
import zipfile
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from runtime_agent.samples import numpy_dtype
from schemas.errors import InvalidRequest, KilnError, PayloadTooLarge
from schemas.manifest import TensorSpec

#: Deepest JSON nesting an inference request may have: the envelope takes three or four
#: levels and a tensor one per axis.
MAX_JSON_DEPTH = 64

#: A JSON string, escapes included (matched by the C regex engine, linear in the input).
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
#: Every byte but the four brackets, for ``bytes.translate``.
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_DELTA = np.zeros(256, np.int8)
_DELTA[list(b"[{")] = 1
_DELTA[list(b"]}")] = -1


def json_depth(body: bytes) -> int:
    """The deepest nesting of arrays and objects in ``body`` (brackets inside strings do not
    count), computed without parsing it."""
    brackets = _STRING.sub(b'""', body).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    return int(np.cumsum(_DELTA[np.frombuffer(brackets, np.uint8)], dtype=np.int64).max())


def load_json(body: bytes | memoryview, *, max_bytes: int, what: str,
              max_depth: int = MAX_JSON_DEPTH, limit_name: str = "KILN_AGENT_MAX_JSON_BYTES"
              ) -> Any:
    """``body`` parsed, once its size and nesting depth are within bounds."""
    if len(body) > max_bytes:
        raise PayloadTooLarge(f"{what} is {len(body)} bytes of JSON, over the limit of "
                              f"{max_bytes} ({limit_name}); send large tensors as npz or "
                              f"with the binary-data extension", limit_bytes=max_bytes)
    raw = bytes(body)
    depth = json_depth(raw)
    if depth > max_depth:
        raise InvalidRequest(f"{what} nests {depth} levels deep; at most {max_depth} are "
                             f"accepted (a tensor takes one level per axis)",
                             depth=depth, max_depth=max_depth)
    try:
        return json.loads(raw)
    except RecursionError as exc:  # unbalanced brackets hidden from the depth count
        raise InvalidRequest(f"{what} nests deeper than the parser allows") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"{what} is not valid JSON: {exc}") from exc


def _describe(spec: TensorSpec) -> str:
    return f"{spec.name}: {spec.dtype}{list(spec.shape)}"


def check_npz(body: bytes, specs: Sequence[TensorSpec], max_bytes: int) -> None:
    """Read the header of every array in the npz ``body`` and refuse, before anything is
    allocated: a member that is not an ``.npy``, an array the model has no input for, a dtype
    or shape the signature does not admit, and arrays that together exceed ``max_bytes``."""
    expected = {spec.name: spec for spec in specs}
    try:
        archive = zipfile.ZipFile(io.BytesIO(body))
    except (zipfile.BadZipFile, ValueError, OSError, EOFError):
        return  # not a zip: numpy's loader says what it is instead (nothing to allocate)
    total = 0
    with archive:
        for info in archive.infolist():
            if not info.filename.endswith(".npy"):
                raise InvalidRequest(f"npz member {info.filename!r} is not an .npy array; an "
                                     f"npz holds one <input name>.npy per input")
            name = info.filename.removesuffix(".npy")
            spec = expected.get(name)  # an unknown name is reported with the others, later
            try:
                with archive.open(info) as member:
                    version = np.lib.format.read_magic(member)
                    if version == (1, 0):
                        shape, _fortran, dtype = np.lib.format.read_array_header_1_0(member)
                    elif version in ((2, 0), (3, 0)):
                        shape, _fortran, dtype = np.lib.format.read_array_header_2_0(member)
                    else:
                        raise ValueError(f"unknown .npy format version {version}")
            except (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
                raise InvalidRequest(f"array {name!r} of the npz has no readable .npy header: "
                                     f"{exc}") from exc
            if dtype.hasobject:
                raise InvalidRequest(f"array {name!r} of the npz cannot be read: it holds "
                                     f"Python objects (pickles are refused)")
            want = _numpy_dtype(spec.dtype) if spec is not None else None
            if want is not None and dtype != want:
                raise InvalidRequest(f"input {name!r}: expected dtype {spec.dtype} "
                                     f"({_describe(spec)}); the npz declares {dtype}")
            if spec is not None and spec.shape != ["..."] and (len(shape) != len(spec.shape) or any(
                    isinstance(want, int) and want != got
                    for want, got in zip(spec.shape, shape, strict=True))):
                raise InvalidRequest(f"input {name!r}: expected shape {list(spec.shape)} "
                                     f"({_describe(spec)}); the npz declares "
                                     f"{list(shape)}")
            size = math.prod(shape) * dtype.itemsize
            total += size
            if total > max_bytes:
                raise PayloadTooLarge(
                    f"the npz's arrays unpack to {total} bytes as their headers declare (array "
                    f"{name!r}: {list(shape)} of {dtype}), over the limit of {max_bytes} "
                    f"(KILN_AGENT_MAX_BODY_BYTES); nothing was allocated",
                    limit_bytes=max_bytes)


def _numpy_dtype(name: str) -> np.dtype | None:
    """The numpy dtype of a signature's dtype name; ``None`` for one numpy has no equivalent
    of (a string tensor), which the executor checks instead."""
    try:
        return numpy_dtype(name)
    except KilnError:
        return None

"""Seeded random feeds for an input signature: one definition of how Kiln draws sample inputs.

The compiler verifies and benchmarks engines on them (``compiler_worker.verify``); an agent
health-checks a freshly loaded engine on them before it serves.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from schemas.errors import InvalidModel, InvalidRequest
from schemas.manifest import TensorSpec
from schemas.onnx_model import UNKNOWN_RANK

#: Integer inputs with no range of their own are drawn from [0, INT_HIGH): small enough to
#: index most tables a model gathers from. ``compiler_worker.inputs`` finds the real range of
#: an input that indexes a table (a vocabulary, a type table, a one-hot depth) in the graph.
INT_HIGH = 8


@dataclass(frozen=True)
class IntegerRange:
    """Feeds for one integer input drawn uniformly from ``[low, high)``, and why that range."""

    low: int
    high: int
    #: What the range comes from, e.g. ``Gather on embeddings.word_embeddings.weight axis 0``.
    reason: str = ""

    def describe(self, dtype: str) -> str:
        text = f"{dtype} in [{self.low}, {self.high})"
        return f"{text} ({self.reason})" if self.reason else text


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype named by a manifest (``float32``, ``int64``, ``bfloat16``, ...)."""
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes  # bfloat16 / float8 names, installed with onnx

        try:
            return np.dtype(getattr(ml_dtypes, name))
        except AttributeError:
            raise InvalidModel(f"dtype {name!r} has no numpy equivalent") from None


def sample_shape(spec: TensorSpec, shape: list[int] | None = None) -> list[int]:
    """``shape`` when given (checked against the spec's rank and fixed dimensions), else the
    spec's shape with every dynamic dimension set to 1."""
    if shape is not None:
        shape = [int(d) for d in shape]
        if list(spec.shape) != UNKNOWN_RANK:
            fixed = [d if isinstance(d, int) else None for d in spec.shape]
            if len(shape) != len(fixed) or any(
                want is not None and want != got for want, got in zip(fixed, shape, strict=True)
            ):
                raise InvalidRequest(
                    f"sample shape {shape} for input {spec.name!r} does not fit its shape "
                    f"{list(spec.shape)}"
                )
        return shape
    if list(spec.shape) == UNKNOWN_RANK:
        raise InvalidRequest(
            f"input {spec.name!r} has an unknown rank; a sample shape must be given for it"
        )
    return [d if isinstance(d, int) else 1 for d in spec.shape]


def _check_ranges(specs: list[TensorSpec], ranges: Mapping[str, IntegerRange]) -> None:
    by_name = {spec.name: spec for spec in specs}
    for name, bounds in ranges.items():
        spec = by_name.get(name)
        if spec is None:
            raise InvalidRequest(
                f"an integer range is given for {name!r}, which is not an input; the inputs "
                f"are {sorted(by_name)}"
            )
        dtype = numpy_dtype(spec.dtype)
        if dtype.kind not in "iu":
            raise InvalidRequest(
                f"an integer range is given for input {name!r}, which is a {spec.dtype} "
                f"tensor; ranges apply to integer inputs only"
            )
        info = np.iinfo(dtype)
        if not info.min <= bounds.low < bounds.high <= info.max + 1:
            raise InvalidRequest(
                f"integer range [{bounds.low}, {bounds.high}) for input {name!r} is empty or "
                f"does not fit {spec.dtype} (expected {info.min} <= low < high <= "
                f"{info.max + 1})"
            )


def describe_inputs(
    specs: list[TensorSpec], ranges: Mapping[str, IntegerRange] | None = None
) -> dict[str, str]:
    """What ``sample_inputs`` draws for each input, in words (for manifests and reports)."""
    ranges = ranges or {}
    _check_ranges(specs, ranges)
    described: dict[str, str] = {}
    for spec in specs:
        kind = numpy_dtype(spec.dtype).kind
        if kind == "b":
            described[spec.name] = f"{spec.dtype} fair coin flips"
        elif kind in "iu":
            bounds = ranges.get(spec.name) or IntegerRange(
                0, INT_HIGH, "default: no table it indexes was found")
            described[spec.name] = bounds.describe(spec.dtype)
        elif kind in "OSU":
            described[spec.name] = f"{spec.dtype}: cannot be generated"
        else:
            described[spec.name] = f"{spec.dtype} standard normal"
    return described


def sample_inputs(
    specs: list[TensorSpec],
    shapes: Mapping[str, list[int]] | None = None,
    *,
    seed: int = 0,
    ranges: Mapping[str, IntegerRange] | None = None,
) -> dict[str, np.ndarray]:
    """One seeded random feed for ``specs`` (same seed, shapes and ranges, same arrays).

    ``shapes`` gives concrete shapes by input name; inputs it omits get their spec's shape
    with dynamic dimensions set to 1. Floats are standard normal, booleans fair coin flips,
    integers uniform in ``ranges[name]`` where given (``InvalidRequest`` if that range names
    no integer input or does not fit its dtype), else in ``[0, INT_HIGH)``. String inputs
    raise ``InvalidModel``.
    """
    shapes = shapes or {}
    ranges = ranges or {}
    _check_ranges(specs, ranges)
    rng = np.random.default_rng(seed)
    feed: dict[str, np.ndarray] = {}
    for spec in specs:
        shape = sample_shape(spec, shapes.get(spec.name))
        dtype = numpy_dtype(spec.dtype)
        if dtype.kind == "b":
            feed[spec.name] = np.asarray(rng.random(shape) < 0.5)  # a 0-d array, not np.bool_
        elif dtype.kind in "iu":
            bounds = ranges.get(spec.name)
            low, high = (bounds.low, bounds.high) if bounds else (0, INT_HIGH)
            feed[spec.name] = rng.integers(low, high, size=shape).astype(dtype)
        elif dtype.kind == "c":
            feed[spec.name] = (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)
                               ).astype(dtype)
        elif dtype.kind in "OSU":
            raise InvalidModel(
                f"input {spec.name!r} is a {spec.dtype} tensor; Kiln cannot generate random "
                f"inputs of that type"
            )
        else:  # float16/32/64 and ml_dtypes floats (bfloat16, float8 ...)
            feed[spec.name] = rng.standard_normal(shape).astype(dtype)
    return feed

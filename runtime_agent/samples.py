"""Seeded random feeds for an input signature: one definition of how Kiln draws sample inputs.

The compiler verifies and benchmarks engines on them (``compiler_worker.verify``); an agent
health-checks a freshly loaded engine on them before it serves.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from schemas.errors import InvalidModel, InvalidRequest
from schemas.manifest import TensorSpec
from schemas.onnx_model import UNKNOWN_RANK

#: Integer inputs are drawn from [0, INT_HIGH): small enough to index the tables a model
#: gathers from (token ids, class ids), so random feeds stay in range.
INT_HIGH = 8


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


def sample_inputs(
    specs: list[TensorSpec],
    shapes: Mapping[str, list[int]] | None = None,
    *,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """One seeded random feed for ``specs`` (same seed and shapes, same arrays).

    ``shapes`` gives concrete shapes by input name; inputs it omits get their spec's shape
    with dynamic dimensions set to 1. Floats are standard normal, integers uniform in
    ``[0, INT_HIGH)``, booleans fair coin flips. String inputs raise ``InvalidModel``.
    """
    shapes = shapes or {}
    rng = np.random.default_rng(seed)
    feed: dict[str, np.ndarray] = {}
    for spec in specs:
        shape = sample_shape(spec, shapes.get(spec.name))
        dtype = numpy_dtype(spec.dtype)
        if dtype.kind == "b":
            feed[spec.name] = rng.random(shape) < 0.5
        elif dtype.kind in "iu":
            feed[spec.name] = rng.integers(0, INT_HIGH, size=shape).astype(dtype)
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

"""Device-free shape function of ``ai.onnx.contrib::Inverse`` (onnxruntime-extensions' native
kernel inverts one float 2-D square matrix). The kernel itself is the native library the
build script copies into ``lib/``; Kiln's compiler uses this function for shape inference.
"""

from __future__ import annotations


def inverse_shape(inputs, attributes):
    """``float32[n, n]`` → ``float32[n, n]``; anything but a square 2-D matrix is refused."""
    from kiln.ops import TensorType

    (a,) = inputs
    if a.shape is not None:
        if len(a.shape) != 2:
            raise ValueError(f"Inverse takes a 2-D matrix; got shape {list(a.shape)}")
        rows, cols = a.shape
        if isinstance(rows, int) and isinstance(cols, int) and rows != cols:
            raise ValueError(f"Inverse takes a square matrix; got {rows}x{cols}")
    return [TensorType(a.dtype, a.shape)]

"""``kiln.examples::Swish``: ``y = x * sigmoid(beta * x)`` (a fused activation), written with
``kiln.ops``: declaration, device-free shape function, and a numpy kernel for onnxruntime on
the CPU. ``plugin.json`` beside this file points at ``swish_shape`` and ``swish_cpu``.

Try it without any runtime::

    >>> import numpy as np, swish
    >>> swish.swish(np.array([0.0, 1.0], np.float32), beta=1.0)
    array([0.       , 0.7310586], dtype=float32)
"""

from __future__ import annotations

import numpy as np

from kiln import ops

swish = ops.custom_op(
    "kiln.examples::Swish",
    inputs={"x": "float32"},
    outputs={"y": "float32"},
    attributes={"beta": 1.0},
    doc="y = x * sigmoid(beta * x), elementwise",
)


@swish.register_shape
def swish_shape(inputs, attributes):
    """Elementwise: the output has the input's dtype and shape (symbolic dims included)."""
    (x,) = inputs
    return [ops.TensorType(x.dtype, x.shape)]


@swish.register_kernel("onnxruntime", "cpu")
def swish_cpu(ctx, inputs, outputs, attributes):
    """``y = x / (1 + exp(-beta * x))`` into the pre-allocated output, one scratch buffer."""
    x, y = inputs[0].numpy(), outputs[0].numpy()
    t = ctx.allocate(x.shape, x.dtype)
    np.multiply(x, -attributes["beta"], out=t)
    with np.errstate(over="ignore"):  # exp(+large) = inf gives x / inf = 0, the right limit
        np.exp(t, out=t)
    t += 1
    np.divide(x, t, out=y)

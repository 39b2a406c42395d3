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


# PyTorch: the same op as ``torch.ops.kiln_examples.Swish(x, *, beta=1.0)`` (Kiln registers it
# with ``torch.library`` when the plugin loads for a torch backend, its fake implementation
# derived from ``swish_shape``). Kernels take and return torch tensors.

@swish.register_kernel("torch", "cpu")
def swish_torch_cpu(x, *, beta=1.0):
    """``x * sigmoid(beta * x)`` with torch's CPU kernels."""
    import torch

    return x * torch.sigmoid(x * beta)


_TRITON_KERNEL = None


def _triton_kernel():
    """The Triton kernel, compiled on first use (Triton ships with CUDA builds of torch)."""
    global _TRITON_KERNEL
    if _TRITON_KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def kernel(x_ptr, y_ptr, beta, n, BLOCK: tl.constexpr):
            offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            mask = offsets < n
            x = tl.load(x_ptr + offsets, mask=mask)
            y = x / (1.0 + tl.exp(-beta * x))
            tl.store(y_ptr + offsets, y, mask=mask)

        _TRITON_KERNEL = kernel
    return _TRITON_KERNEL


@swish.register_kernel("torch", "cuda")
def swish_torch_cuda(x, *, beta=1.0):
    """One Triton program per 1024 elements, on the tensor's CUDA stream."""
    import torch

    x = x.contiguous()
    y = torch.empty_like(x)
    n = x.numel()
    if n:
        block = 1024
        _triton_kernel()[((n + block - 1) // block,)](x, y, float(beta), n, BLOCK=block)
    return y

"""Custom-op plugins in the runtime: the op registry, the kernel interface, bundle loading and
ABI tags. Each technology's adapter (what a session registers for a model's custom ops) lives
in its executor's folder, ``runtime_agent.executors.<tech>.custom_ops``, and is reached through
the executor class (``Executor.custom_op_adapter``).

An op is named ``domain::OpType``. Its device-free half — the ``OpSpec`` (signature,
attributes with defaults) and the shape function — is registered apart from its kernels per
(backend, device): Python kernels (``kernel(ctx, inputs, outputs, attributes)``) or native
libraries with an ABI tag. See docs/custom-ops.md.
"""

from runtime_agent.plugins.abi import (
    check_abi,
    parse_abi,
    platform_tag,
    runtime_abi,
)
from runtime_agent.plugins.dispatch import KernelCall, as_view, invoke_kernel, numpy_dtype
from runtime_agent.plugins.errors import (
    AbiMismatch,
    DuplicateOp,
    NoImplementation,
    ShapeFunctionError,
    UnknownOp,
)
from runtime_agent.plugins.loader import (
    LoadedPlugin,
    Target,
    load_bundle,
    load_plugin,
    read_manifest,
)
from runtime_agent.plugins.registry import (
    NativeLibrary,
    OpDefinition,
    OpRegistry,
    PythonKernel,
    split_op,
)
from runtime_agent.plugins.types import (
    Kernel,
    KernelContext,
    ScratchAllocator,
    ShapeFunction,
    TensorType,
    TensorView,
    resolve_attributes,
)

__all__ = [
    "AbiMismatch",
    "DuplicateOp",
    "Kernel",
    "KernelCall",
    "KernelContext",
    "LoadedPlugin",
    "NativeLibrary",
    "NoImplementation",
    "OpDefinition",
    "OpRegistry",
    "PythonKernel",
    "ScratchAllocator",
    "ShapeFunction",
    "ShapeFunctionError",
    "Target",
    "TensorType",
    "TensorView",
    "UnknownOp",
    "as_view",
    "check_abi",
    "invoke_kernel",
    "load_bundle",
    "load_plugin",
    "numpy_dtype",
    "parse_abi",
    "platform_tag",
    "read_manifest",
    "resolve_attributes",
    "runtime_abi",
    "split_op",
]

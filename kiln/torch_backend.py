"""How ``torch.compile(model, backend="kiln")`` finds Kiln without ``import kiln.torch``.

``pyproject.toml`` declares this function in the ``torch_dynamo_backends`` entry-point group,
which torch reads the first time it looks up a backend name it does not know. The function
imports ``kiln.torch`` (and the compile pipeline behind it) only when a graph is compiled.
"""

from __future__ import annotations

from typing import Any


def compile_backend(gm: Any, example_inputs: list[Any], **kwargs: Any) -> Any:
    """``kiln.torch.compile_backend``, imported on first use."""
    from kiln.torch import compile_backend as backend

    return backend(gm, example_inputs, **kwargs)

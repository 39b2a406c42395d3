"""Reading submitted ONNX bytes (the definitions live in ``schemas.onnx_model``, shared with
the API)."""

from schemas.onnx_model import (
    UNKNOWN_DIM,
    UNKNOWN_RANK,
    default_opset,
    load_model_bytes,
    signature,
)

__all__ = ["UNKNOWN_DIM", "UNKNOWN_RANK", "default_opset", "load_model_bytes", "signature"]

"""Models as the API reports them."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict

from schemas.manifest import TensorSpec


class ModelInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    name: str
    sha256: str
    size_bytes: int
    #: ``onnx`` (a ``.onnx`` or a model archive) or ``torch-export`` (a ``torch.export.save``
    #: archive): which backends can take it (``Backend.model_formats``).
    format: Literal["onnx", "torch-export"] = "onnx"
    #: ONNX: the default-domain opset; torch-export: the program's aten opset version.
    opset: int
    #: ONNX: the IR version; torch-export: the export serialization schema's major version.
    ir_version: int
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    created_at: datetime


class ModelCheck(BaseModel):
    """An uploaded model as its inspection child answers it (``artifact_store.inspection``)
    to the API (``services.api.inspection``): its blob's media type, format and what the API
    records in ``ModelInfo``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    media_type: str
    format: Literal["onnx", "torch-export"]
    opset: int
    ir_version: int
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]

"""Models as the API reports them."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict

from schemas.manifest import TensorSpec


class ModelInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    name: str
    sha256: str
    size_bytes: int
    opset: int
    ir_version: int
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    created_at: datetime

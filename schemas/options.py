"""Compile options, canonicalized and hashed into the options digest."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas._canonical import canonical_json, sha256_hex


class Precision(StrEnum):
    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    INT8 = "int8"


Dim = Annotated[int, Field(ge=1)]


class ShapeProfile(BaseModel):
    """min/opt/max shapes of one input with dynamic axes (TensorRT-style optimization profile).

    Verification and benchmarking feed the ``opt`` shape.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    min: list[Dim]
    opt: list[Dim]
    max: list[Dim]

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if not (len(self.min) == len(self.opt) == len(self.max)):
            raise ValueError(
                f"min, opt and max must have the same rank; got {self.min}, {self.opt}, {self.max}"
            )
        for lo, mid, hi in zip(self.min, self.opt, self.max, strict=True):
            if not lo <= mid <= hi:
                raise ValueError(
                    f"expected min <= opt <= max on every axis; got {self.min}, {self.opt}, "
                    f"{self.max}"
                )
        return self


class Tolerance(BaseModel):
    """An output element passes when |engine - reference| <= atol + rtol * |reference|."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    atol: float = Field(1e-4, ge=0)
    rtol: float = Field(1e-3, ge=0)


class CompileOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    precision: Precision = Precision.FP32
    #: 0 = none, 1 = basic (portable), 2 = extended, 3 = all (hardware-specific layouts).
    optimization_level: int = Field(3, ge=0, le=3)
    #: Input name → profile, for inputs with dynamic axes.
    shapes: dict[str, ShapeProfile] = Field(default_factory=dict)
    tolerance: Tolerance = Field(default_factory=Tolerance)
    #: Seconds the backend may spend tuning (TensorRT tactics); 0 = backend default.
    tuning_budget_s: float = Field(0, ge=0)
    #: Backends to try, in order; empty = the best the worker's hardware supports.
    backends: list[Literal["onnxruntime", "tensorrt"]] = Field(default_factory=list)
    #: Random inputs used for verification and benchmarking.
    verify_samples: int = Field(3, ge=1, le=64)
    benchmark_iterations: int = Field(50, ge=1, le=10_000)
    seed: int = 0

    @model_validator(mode="after")
    def _int8_needs_calibration(self) -> Self:
        if self.precision is Precision.INT8:
            raise ValueError(
                "precision int8 needs calibration data, which this version does not accept yet; "
                "use fp32, fp16 or bf16"
            )
        return self

    def digest(self) -> str:
        """sha256 of the canonical form: equal options, equal digest."""
        return sha256_hex(canonical_json(self))

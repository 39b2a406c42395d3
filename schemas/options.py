"""Compile options, canonicalized and hashed into the options digest."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas._canonical import canonical_json, sha256_hex


class Precision(StrEnum):
    """The precision policy of a compile.

    ``fp32``: exact numerics; every output element within ``tolerance`` of the fp32
    reference. ``auto``: reduced precision (int8, bf16, fp16) is allowed where the
    hardware has it and the ``accuracy`` gate holds on the samples. ``fp16``, ``bf16``,
    ``int8``: that precision only, judged by the same gate.
    """

    FP32 = "fp32"
    AUTO = "auto"
    FP16 = "fp16"
    BF16 = "bf16"
    INT8 = "int8"

    @property
    def exact(self) -> bool:
        return self is Precision.FP32


class Tune(StrEnum):
    #: Build every candidate the backends offer for this hardware; keep the fastest that passes.
    AUTO = "auto"
    #: Build the backend's default configuration only.
    OFF = "off"


class Portability(StrEnum):
    #: The fastest engine for exactly this fingerprint key.
    EXACT = "exact"
    #: Only configurations whose engine runs on every node of the backend's portable key.
    PORTABLE = "portable"


class AccuracyMetric(StrEnum):
    #: Cosine similarity of each output (flattened) with the fp32 reference; worst output counts.
    COSINE = "cosine"
    #: Share of samples whose arg-max over the last axis of the first output agrees.
    TOP1_AGREEMENT = "top1_agreement"
    #: Largest absolute difference over every output element.
    MAX_ABS = "max_abs"


class AccuracyGate(BaseModel):
    """How reduced-precision candidates are judged against the fp32 reference on the samples:
    ``cosine`` and ``top1_agreement`` pass at or above ``threshold``, ``max_abs`` at or below."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    metric: AccuracyMetric = AccuracyMetric.COSINE
    threshold: float = Field(0.99, ge=0)

    def passes(self, value: float) -> bool:
        if self.metric is AccuracyMetric.MAX_ABS:
            return value <= self.threshold
        return value >= self.threshold

DatasetId = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
BackendName = Annotated[str, Field(pattern=r"^[a-z][a-z0-9_-]{0,31}$")]


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
    """What a compile must achieve. Canonicalized and hashed into the options digest (the cache
    key), so two requests that mean the same thing share one artifact."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    precision: Precision = Precision.FP32
    #: Judges reduced-precision candidates (``precision`` other than ``fp32``).
    accuracy: AccuracyGate = Field(default_factory=AccuracyGate)
    #: ``auto``: build, verify and benchmark every candidate; keep the fastest that passes.
    tune: Tune = Tune.AUTO
    #: ``portable``: only engines that run on every node of the backend's portable key.
    portability: Portability = Portability.EXACT
    #: Pin the backend's optimization level (0 none … 3 all); ``None``: the tuner decides
    #: (with ``tune: off``, the backend's default).
    optimization_level: int | None = Field(None, ge=0, le=3)
    #: Input name → profile, for inputs with dynamic axes.
    shapes: dict[str, ShapeProfile] = Field(default_factory=dict)
    tolerance: Tolerance = Field(default_factory=Tolerance)
    #: Wall-clock seconds the tuner may spend on candidates (the first candidate always builds).
    tuning_budget_s: float = Field(300, gt=0, le=86_400)
    #: Backends to try, in order; empty = every backend the worker's hardware supports.
    backends: list[BackendName] = Field(default_factory=list)
    #: Dataset (sha256 of an uploaded ``.npz``) of sample inputs for verification, accuracy and
    #: benchmarking; ``None``: inputs are generated to fit the graph.
    samples: DatasetId | None = None
    #: Dataset of representative inputs for static int8 calibration.
    calibration: DatasetId | None = None
    #: Generated inputs used for verification when no ``samples`` are given.
    verify_samples: int = Field(3, ge=1, le=64)
    benchmark_iterations: int = Field(50, ge=1, le=10_000)
    seed: int = 0

    @model_validator(mode="after")
    def _gate_makes_sense(self) -> Self:
        gate = self.accuracy
        if gate.metric is not AccuracyMetric.MAX_ABS and gate.threshold > 1:
            raise ValueError(
                f"accuracy.threshold for {gate.metric.value} is a fraction in [0, 1]; got "
                f"{gate.threshold}"
            )
        return self

    def digest(self) -> str:
        """sha256 of the canonical form: equal options, equal digest."""
        return sha256_hex(canonical_json(self))

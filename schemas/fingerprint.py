"""The hardware fingerprint: what a node is, and which toolchain it runs."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class CpuInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    arch: str = Field(description="Machine architecture, normalized: x86_64 or aarch64")
    vendor: str = ""
    model: str = ""
    #: ISA feature flags, lower-case (avx2, avx512f, avx512_vnni, amx_tile, neon, sve, ...).
    features: list[str] = Field(default_factory=list)
    cores: int = 0
    memory_bytes: int = 0


class AcceleratorInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: str = "cuda"
    name: str
    compute_capability: str = ""
    memory_bytes: int = 0
    sm_count: int = 0
    driver: str = ""


class RuntimeVersions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    onnxruntime: str | None = None
    onnx: str | None = None
    tensorrt: str | None = None
    cuda: str | None = None
    kiln: str | None = None


class HardwareFingerprint(BaseModel):
    """The full description stored with every artifact ("which hardware built this?")."""

    model_config = ConfigDict(extra="forbid")

    os: str = ""
    cpu: CpuInfo
    accelerators: list[AcceleratorInfo] = Field(default_factory=list)
    runtimes: RuntimeVersions = Field(default_factory=RuntimeVersions)
    #: Set when the fingerprint was declared or simulated instead of detected.
    source: str = "detected"

"""The hardware fingerprint: what a node is, and which toolchain it runs."""

from __future__ import annotations

from typing import Annotated

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


#: Installed toolchain versions by name: every backend's runtime (each executor names its own and
#: probes its version), plus ``onnx``, ``cuda`` (the driver's CUDA version) and ``kiln``. A
#: declared fingerprint overrides one entry with ``{"runtimes": {"<name>": "<version>"}}``.
RuntimeVersions = dict[Annotated[str, Field(pattern=r"^[a-z][a-z0-9_.-]{0,63}$")], str | None]


class HardwareFingerprint(BaseModel):
    """The full description stored with every artifact ("which hardware built this?")."""

    model_config = ConfigDict(extra="forbid")

    os: str = ""
    cpu: CpuInfo
    accelerators: list[AcceleratorInfo] = Field(default_factory=list)
    runtimes: RuntimeVersions = Field(default_factory=dict)
    #: Set when the fingerprint was declared or simulated instead of detected.
    source: str = "detected"

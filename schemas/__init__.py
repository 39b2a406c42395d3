"""Kiln's wire models (pydantic v2). No I/O, and nothing else of ours is imported here."""

from schemas.errors import ErrorBody, ErrorCode, KilnError
from schemas.fingerprint import AcceleratorInfo, CpuInfo, HardwareFingerprint, RuntimeVersions
from schemas.jobs import CompileJob, CompileJobCreate, JobStage, JobStatus, JobTarget
from schemas.manifest import (
    ArtifactManifest,
    ArtifactSummary,
    BenchmarkResult,
    BlobRef,
    ManifestSignature,
    TensorSpec,
    VerificationResult,
)
from schemas.models import ModelInfo
from schemas.options import CompileOptions, Precision, ShapeProfile

__all__ = [
    "AcceleratorInfo",
    "ArtifactManifest",
    "ArtifactSummary",
    "BenchmarkResult",
    "BlobRef",
    "CompileJob",
    "CompileJobCreate",
    "CompileOptions",
    "CpuInfo",
    "ErrorBody",
    "ErrorCode",
    "HardwareFingerprint",
    "JobStage",
    "JobStatus",
    "JobTarget",
    "KilnError",
    "ManifestSignature",
    "ModelInfo",
    "Precision",
    "RuntimeVersions",
    "ShapeProfile",
    "TensorSpec",
    "VerificationResult",
]

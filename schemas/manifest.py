"""Artifact manifests: what was built, from what, on what, and how well it did."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
)

from schemas._canonical import canonical_json
from schemas._versioned import validate_versioned, version_field
from schemas.fingerprint import EngineRequirements, HardwareFingerprint, TuningContext
from schemas.options import CompileOptions
from schemas.plugins import PluginRef
from schemas.tuning import TuningTable

SHA256_PATTERN = r"^[0-9a-f]{64}$"
#: The manifest schema this Kiln writes. A reader accepts any ``1.x`` (dropping fields a newer
#: minor added) and refuses ``2.0``; the first manifests wrote the integer ``1`` (= ``1.0``).
#: 1.1: the tuning table's noise figures (``TuningTable.noise``, ``CandidateResult.spread``).
#: 1.2: the engine's ``requirements`` and ``tuning_context`` (absent from older manifests: such
#: an engine requires exactly its build host's key, see ``legacy_requirements``).
#: 1.3: ``deferred`` on the verification and the benchmark (an engine cross-compiled for an
#: architecture the worker cannot run: the node's golden check verifies it).
MANIFEST_SCHEMA_VERSION = "1.3"

#: What a cross-compiled engine's verification and benchmark say: the worker could not run it,
#: and emulation is never timed, so the node of its architecture decides.
DEFERRED_TO_NODE = "deferred to node"

ArtifactState = Literal["ready", "broken"]


class TensorSpec(BaseModel):
    """One input or output. A dimension is an int, or a string naming a dynamic axis."""

    model_config = ConfigDict(extra="forbid")

    name: str
    dtype: str
    shape: list[int | str]
    #: For an integer input: generated values stay in ``[low, high)`` (indices inside the table
    #: they gather from, 0/1 masks). Agents draw their health-check inputs from it too. Left out
    #: of the serialized form when unset.
    value_range: tuple[int, int] | None = None

    @model_serializer(mode="wrap")
    def _omit_unset_range(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if data.get("value_range") is None:
            data.pop("value_range", None)
        return data


class BlobRef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    #: Role of the blob inside the artifact ("engine", "model", ...).
    name: str
    sha256: str = Field(pattern=SHA256_PATTERN)
    size: int = Field(ge=0)
    media_type: str = "application/octet-stream"


class VerificationResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    passed: bool
    samples: int
    max_abs_error: float
    max_rel_error: float
    atol: float
    rtol: float
    reference: str = Field(description="What produced the reference outputs")
    per_output: dict[str, dict[str, float]] = Field(default_factory=dict)
    #: Set (``DEFERRED_TO_NODE``: why) when the worker could not run the engine: ``passed`` is
    #: then false, and the agent's golden check on activation is mandatory and decides.
    deferred: str | None = None


class BenchmarkResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    iterations: int
    warmup: int
    p50_ms: float
    p90_ms: float
    mean_ms: float
    min_ms: float
    input_shapes: dict[str, list[int]] = Field(default_factory=dict)
    #: The same model on the unoptimized reference session, measured in the same run.
    reference_p50_ms: float | None = None
    #: Set (why) when nothing was timed on the worker: the timings are zero and mean nothing.
    deferred: str | None = None


class ManifestSignature(BaseModel):
    """The signature embedded in the first manifests (read, never written: manifests are now
    stored as signed envelopes whose signature covers the stored bytes)."""

    model_config = ConfigDict(extra="forbid")

    algorithm: str = "ed25519"
    key_id: str
    value: str = Field(description="base64 signature over the canonical unsigned manifest")


class ArtifactManifest(BaseModel):
    """The signed description of one engine. Blobs are listed by sha256 and size."""

    model_config = ConfigDict(extra="forbid")

    #: ``"MAJOR.MINOR"`` (see ``MANIFEST_SCHEMA_VERSION``).
    schema_version: str = MANIFEST_SCHEMA_VERSION
    artifact_id: str
    model_sha256: str = Field(pattern=SHA256_PATTERN)
    options_digest: str = Field(pattern=SHA256_PATTERN)
    options: CompileOptions
    backend: str
    fingerprint_key: str
    #: A coarser key naming every node this engine also runs on (a portable onnxruntime
    #: engine, a hardware-compatible TensorRT plan); ``None`` when only the exact key fits.
    compatibility_key: str | None = None
    #: Toolchain identity that is part of the cache key (backend runtime + kiln pipeline).
    toolchain: str
    build_fingerprint: HardwareFingerprint
    blobs: list[BlobRef]
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    #: Backend-specific settings the executor needs to load the engine.
    runtime_config: dict[str, object] = Field(default_factory=dict)
    #: The custom-op plugin bundles the engine needs, loaded by agents before it.
    plugins: list[PluginRef] = Field(default_factory=list)
    passes: list[str] = Field(default_factory=list)
    verification: VerificationResult
    benchmark: BenchmarkResult
    #: What verification and benchmarking fed: ``dataset:<id>``, or ``generated`` with the rule
    #: applied per input (e.g. integer indices kept inside the table they gather from).
    inputs_source: str = "generated"
    #: The precision the winning engine computes in (``fp32``, ``int8-static-qdq``, ...).
    precision: str = "fp32"
    #: Every candidate the tuner built, verified and measured, and which won.
    tuning: TuningTable | None = None
    #: What the engine needs to run correctly (derived from the winning candidate); ``None``
    #: in manifests older than 1.2.
    requirements: EngineRequirements | None = None
    #: What the winner was tuned for; ``None`` in manifests older than 1.2.
    tuning_context: TuningContext | None = None
    created_at: datetime
    #: Only in manifests of the first, embedded-signature form (read for compatibility).
    signature: ManifestSignature | None = None

    @field_validator("schema_version", mode="before")
    @classmethod
    def _version(cls, value: object) -> str:
        return version_field(value, what="an artifact manifest")

    def unsigned_bytes(self) -> bytes:
        """The manifest's canonical bytes without a signature: what a new manifest's signed
        envelope carries as its payload, byte for byte."""
        return canonical_json(self.model_dump(mode="json", exclude={"signature"}))

    def blob(self, name: str) -> BlobRef:
        for ref in self.blobs:
            if ref.name == name:
                return ref
        raise KeyError(f"manifest {self.artifact_id} has no blob {name!r}; it has "
                       f"{[b.name for b in self.blobs]}")


#: What a manifest without requirements says about itself.
LEGACY_REQUIREMENTS_NOTE = ("the manifest predates requirements (schema < 1.2): it is treated as "
                            "requiring exactly its build host's fingerprint key")


def effective_requirements(manifest: ArtifactManifest) -> EngineRequirements:
    """The manifest's requirements; for one written before 1.2, its build host's exact key
    (or its compatibility key, which then stands for the same rule, as before), and
    says so (``LEGACY_REQUIREMENTS_NOTE`` among the reasons)."""
    if manifest.requirements is not None:
        return manifest.requirements
    return EngineRequirements(arch=manifest.build_fingerprint.cpu.arch,
                              key=manifest.fingerprint_key,
                              reasons=[LEGACY_REQUIREMENTS_NOTE])


def parse_manifest(data: dict[str, Any]) -> ArtifactManifest:
    """A decoded manifest, honouring its ``schema_version`` (``SchemaUnsupported`` for a newer
    major; fields added by a newer minor are ignored)."""
    return validate_versioned(ArtifactManifest, data, current=MANIFEST_SCHEMA_VERSION,
                              what="artifact manifest")


class ArtifactSummary(BaseModel):
    """An artifact as listed by the API."""

    model_config = ConfigDict(extra="forbid")

    id: str
    model_id: str
    backend: str
    fingerprint_key: str
    compatibility_key: str | None = None
    options_digest: str
    toolchain: str
    size_bytes: int
    max_abs_error: float
    p50_ms: float
    created_at: datetime
    #: ``ready``, or ``broken``: the store lost a part of it (a blob, the manifest); it is
    #: never handed out, and a build for its key is queued instead.
    state: ArtifactState = "ready"
    #: Why it is broken: what the store lacks or what did not hash.
    broken_reason: str | None = None

"""Fixtures for the store tests: both stores, a signing key, and a manifest builder."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest

from artifact_store.base import ArtifactStore
from artifact_store.registry import open_store
from artifact_store.signing import Signer, generate_keypair
from schemas.fingerprint import CpuInfo, HardwareFingerprint
from schemas.manifest import (
    ArtifactManifest,
    BenchmarkResult,
    BlobRef,
    TensorSpec,
    VerificationResult,
)
from schemas.options import CompileOptions

ManifestBuilder = Callable[..., ArtifactManifest]


def build_manifest(blobs: list[BlobRef], *, artifact_id: str = "art-1") -> ArtifactManifest:
    """A complete, valid, unsigned manifest listing ``blobs``."""
    options = CompileOptions()
    return ArtifactManifest(
        artifact_id=artifact_id,
        model_sha256="ab" * 32,
        options_digest=options.digest(),
        options=options,
        backend="onnxruntime",
        fingerprint_key="cpu-x86_64-avx2-ort1.18",
        toolchain="onnxruntime-1.18/kiln-0.1.0",
        build_fingerprint=HardwareFingerprint(cpu=CpuInfo(arch="x86_64")),
        blobs=blobs,
        inputs=[TensorSpec(name="x", dtype="float32", shape=["batch", 4])],
        outputs=[TensorSpec(name="y", dtype="float32", shape=["batch", 2])],
        verification=VerificationResult(
            passed=True,
            samples=3,
            max_abs_error=1e-6,
            max_rel_error=1e-5,
            atol=1e-4,
            rtol=1e-3,
            reference="onnx.reference",
        ),
        benchmark=BenchmarkResult(
            iterations=50, warmup=5, p50_ms=1.0, p90_ms=1.2, mean_ms=1.05, min_ms=0.9
        ),
        created_at=datetime(2025, 1, 1, tzinfo=UTC),
    )


@pytest.fixture
def make_manifest() -> ManifestBuilder:
    return build_manifest


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ArtifactStore:
    """The same suite runs on a local directory and on S3 over loopback HTTP (moto)."""
    if request.param == "local":
        return open_store((tmp_path / "store").as_uri())
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = request.getfixturevalue("s3_bucket")
    return open_store(f"s3://{bucket}/some/prefix", s3_endpoint_url=endpoint)


@pytest.fixture
def signer(tmp_path: Path) -> Signer:
    return generate_keypair(tmp_path / "keys" / "signing.pem")

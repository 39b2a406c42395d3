"""Builders for the database tests: models, manifests, and a two-session race."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import TypeVar

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from schemas.fingerprint import CpuInfo, HardwareFingerprint
from schemas.manifest import (
    ArtifactManifest,
    BenchmarkResult,
    BlobRef,
    ManifestSignature,
    TensorSpec,
    VerificationResult,
)
from schemas.models import ModelInfo
from schemas.options import CompileOptions
from services.db import repo

T = TypeVar("T")

FINGERPRINT_KEY = "cpu-x86_64-avx2-ort1.18"
TOOLCHAIN = "onnxruntime-1.18.0+kiln-0.1.0"
INPUTS = [TensorSpec(name="x", dtype="float32", shape=["batch", 3, 224, 224])]
OUTPUTS = [TensorSpec(name="y", dtype="float32", shape=["batch", 1000])]


def sha(seed: object) -> str:
    return hashlib.sha256(str(seed).encode()).hexdigest()


def add_model(session: Session, seed: object = "model", *, name: str = "tiny.onnx") -> ModelInfo:
    model, _ = repo.upsert_model(
        session,
        sha256=sha(seed),
        name=name,
        size_bytes=5 * 1024**3,  # needs BIGINT
        opset=17,
        ir_version=8,
        inputs=INPUTS,
        outputs=OUTPUTS,
        blob_key=f"models/{sha(seed)}",
    )
    return model


def manifest(
    model_id: str,
    *,
    artifact_id: str | None = None,
    options: CompileOptions | None = None,
    fingerprint_key: str = FINGERPRINT_KEY,
    toolchain: str = TOOLCHAIN,
    blob_sizes: tuple[int, ...] = (1000, 24),
    max_abs_error: float = 1.25e-6,
    p50_ms: float = 0.75,
) -> ArtifactManifest:
    options = options or CompileOptions()
    return ArtifactManifest(
        artifact_id=artifact_id or sha((model_id, options.digest(), fingerprint_key, toolchain)),
        model_sha256=model_id,
        options_digest=options.digest(),
        options=options,
        backend="onnxruntime",
        fingerprint_key=fingerprint_key,
        toolchain=toolchain,
        build_fingerprint=HardwareFingerprint(
            os="linux", cpu=CpuInfo(arch="x86_64", vendor="GenuineIntel", features=["avx2"])
        ),
        blobs=[
            BlobRef(name=f"blob{i}", sha256=sha((i, size)), size=size)
            for i, size in enumerate(blob_sizes)
        ],
        inputs=INPUTS,
        outputs=OUTPUTS,
        runtime_config={"providers": ["CPUExecutionProvider"], "threads": 4},
        passes=["fold_constants", "fuse_gelu"],
        verification=VerificationResult(
            passed=True,
            samples=3,
            max_abs_error=max_abs_error,
            max_rel_error=3.1e-5,
            atol=1e-4,
            rtol=1e-3,
            reference="onnx.reference",
            per_output={"y": {"max_abs_error": max_abs_error}},
        ),
        benchmark=BenchmarkResult(
            iterations=50,
            warmup=5,
            p50_ms=p50_ms,
            p90_ms=0.9,
            mean_ms=0.8,
            min_ms=0.7,
            input_shapes={"x": [1, 3, 224, 224]},
        ),
        created_at=datetime(2024, 11, 22, 12, 30, 15, 123456, tzinfo=UTC),
        signature=ManifestSignature(key_id="test-key", value="c2lnbmF0dXJl"),
    )


def _wait_for_lock_waiter(engine: sa.Engine, timeout: float = 10.0) -> None:
    """Until another PostgreSQL backend of this database waits on a lock."""
    deadline = time.monotonic() + timeout
    query = sa.text(
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE datname = current_database() AND wait_event_type = 'Lock'"
    )
    while time.monotonic() < deadline:
        with engine.connect() as conn:
            if conn.scalar(query):
                return
        time.sleep(0.01)
    raise TimeoutError("the second writer never blocked on the first one's row")


def race(
    engine: sa.Engine, factory: sessionmaker[Session], write: Callable[[Session], T]
) -> tuple[T, T]:
    """Two sessions write the same key at once; the second commits after the first.

    The first session writes and holds its transaction open while the second, in another
    thread, writes the same key (past the read-first check, because it cannot see the
    uncommitted row) and blocks on the first one's unique key. On PostgreSQL the first commits
    only once the second is seen waiting on that lock, so the SAVEPOINT path really runs.
    """

    def second() -> T:
        with factory() as session, session.begin():
            return write(session)

    with factory() as first_session, ThreadPoolExecutor(1) as pool:
        with first_session.begin():
            first = write(first_session)
            pending = pool.submit(second)
            if engine.dialect.name == "postgresql":
                _wait_for_lock_waiter(engine)
            else:  # SQLite: the second waits on BEGIN IMMEDIATE
                time.sleep(0.2)
        return first, pending.result(timeout=30)

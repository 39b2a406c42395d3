"""A build for a node of another architecture than this worker's (a cross target,
``compiler_worker.cross``): the engine is built, never run here, so its verification and
benchmark are deferred to the node, whose golden check on activation decides."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from artifact_store.digest import sha256_file
from compiler_worker.artifact_dir import CompileResult, fresh_dir
from compiler_worker.backends.base import Backend, BuiltEngine, Candidate
from compiler_worker.golden import add_golden
from compiler_worker.plan import BuildPlan
from compiler_worker.plugin_prep import UsedPlugins
from runtime_agent.executors import blob_filename
from runtime_agent.fingerprint import detect_cpu
from runtime_agent.golden import GOLDEN_BLOB
from schemas.errors import CompileError, InvalidOptions
from schemas.fingerprint import HardwareFingerprint
from schemas.manifest import (
    DEFERRED_TO_NODE,
    ArtifactManifest,
    BenchmarkResult,
    BlobRef,
    VerificationResult,
)
from schemas.options import CompileOptions
from schemas.tuning import CandidateOutcome, CandidateResult, TuningTable

__all__ = ["cross_build", "runs_here"]

logger = logging.getLogger(__name__)


def runs_here(fingerprint: HardwareFingerprint) -> bool:
    """Whether an engine for ``fingerprint`` can run on this machine: the same architecture.
    One for another (a declared aarch64 node's, cross-compiled) is built, never loaded here."""
    return fingerprint.cpu.arch == detect_cpu().arch


def cross_build(
    model_sha256: str,
    options: CompileOptions,
    *,
    fingerprint: HardwareFingerprint,
    workdir: Path,
    plan: BuildPlan,
    used: UsedPlugins,
    model_path: Path,
    feeds: list[dict[str, np.ndarray]],
    expected: list[dict[str, np.ndarray]],
    reference: str,
    source: str,
    manifest_for: Callable[[BuiltEngine, Candidate, Backend], ArtifactManifest],
) -> CompileResult:
    """An engine for an architecture this worker cannot run: the plan's backend builds its
    default candidate for ``fingerprint``, with no verification and no timing here (emulation
    is never timed, and a winner cannot be picked without timings). The manifest says both
    were deferred to the node, and carries the reference's golden outputs: the agent's golden
    check on activation is then mandatory, and decides. ``reference``: the name of what the
    golden outputs were computed by; ``expected``: those outputs, one per feed."""
    backend = plan.backend
    if not backend.cross_compiles:
        raise InvalidOptions(
            f"the {backend.name} backend does not cross-compile: it cannot build for a "
            f"{fingerprint.cpu.arch} node on this {detect_cpu().arch} worker",
            backend=backend.name, arch=fingerprint.cpu.arch)
    why = (f"{DEFERRED_TO_NODE}: cross-compiled for {fingerprint.cpu.arch} on a "
           f"{detect_cpu().arch} worker, which cannot run it")
    offered = backend.candidates(fingerprint, options)
    candidate = offered[0]
    started = time.perf_counter()
    built = backend.build(model_path, options, fresh_dir(workdir / "cross" / "build"),
                          fingerprint=fingerprint, candidate=candidate,
                          custom_ops=used.adapter)
    build_s = time.perf_counter() - started
    artifact_dir = fresh_dir(workdir / "cross" / "artifact")
    refs = []
    for name, path, media_type in built.blobs:
        digest, size = sha256_file(Path(path))
        ref = BlobRef(name=name, sha256=digest, size=size, media_type=media_type)
        os.replace(path, artifact_dir / blob_filename(ref))
        refs.append(ref)
    results = [CandidateResult(name=candidate.name, backend=backend.name,
                               config=dict(candidate.config), precision=candidate.precision,
                               outcome=CandidateOutcome.WON, reason=why, build_s=build_s)]
    results += [CandidateResult(name=c.name, backend=backend.name, config=dict(c.config),
                                precision=c.precision, outcome=CandidateOutcome.SKIPPED,
                                reason="not built: without timings on the node's hardware no "
                                       "candidate can beat the default")
                for c in offered[1:]]
    table = TuningTable(fingerprint_key=plan.fingerprint_key, toolchain=plan.toolchain,
                        winner=candidate.name, inputs=source, budget_s=options.tuning_budget_s,
                        elapsed_s=build_s, rounds=0, candidates=results)
    manifest = manifest_for(built, candidate, backend).model_copy(update={
        "blobs": refs,
        "verification": VerificationResult(
            passed=False, samples=0, max_abs_error=0.0, max_rel_error=0.0,
            atol=options.tolerance.atol, rtol=options.tolerance.rtol, reference=reference,
            deferred=why),
        "benchmark": BenchmarkResult(iterations=0, warmup=0, p50_ms=0.0, p90_ms=0.0,
                                     mean_ms=0.0, min_ms=0.0, deferred=why),
        "tuning": table,
        "created_at": datetime.now(UTC),
    })
    manifest = add_golden(manifest, artifact_dir, feeds, expected)
    if not any(ref.name == GOLDEN_BLOB for ref in manifest.blobs):
        raise CompileError(
            f"artifact {manifest.artifact_id}: a cross-compiled engine must carry golden "
            f"samples (the node's check is its only verification), and this model's cannot "
            f"be written (string tensors)")
    logger.info("artifact %s ready: %s for %s, %s", manifest.artifact_id, candidate.name,
                fingerprint.cpu.arch, why)
    blob_paths = {ref.name: artifact_dir / blob_filename(ref) for ref in manifest.blobs}
    return CompileResult(manifest=manifest, blob_paths=blob_paths, plugin_paths=used.paths)

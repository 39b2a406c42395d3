"""A cross-compiling worker: its declared targets (``KILN_WORKER_CROSS_TARGETS``) give the
keys it consumes and advertises; a job for such a key is built for the declared node, not
verified or timed here (deferred to the node, with golden samples the node must check)."""

from __future__ import annotations

from pathlib import Path

import pytest

from compiler_worker.config import WorkerSettings
from compiler_worker.cross import cross_targets
from compiler_worker.jobs import JobRunner
from compiler_worker.pipeline import compile_model, plan_build, runs_here
from compiler_worker.worker import Heartbeat
from kiln.examples import mlp
from runtime_agent.fingerprint import detect_fingerprint
from runtime_agent.golden import GOLDEN_BLOB
from schemas._canonical import sha256_hex
from schemas.errors import ConfigError
from schemas.fingerprint import CpuInfo, HardwareFingerprint
from schemas.manifest import DEFERRED_TO_NODE
from schemas.options import CompileOptions
from schemas.tuning import CandidateOutcome

pytest.importorskip("iree.compiler")


@pytest.fixture(scope="module")
def host() -> HardwareFingerprint:
    host = detect_fingerprint()
    if host.cpu.arch != "x86_64" or not host.runtimes.get("iree"):
        pytest.skip("cross-compiles for aarch64 from an x86-64 worker with IREE")
    return host


def test_settings_take_a_comma_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_WORKER_CROSS_TARGETS", "aarch64, /some/node.json")
    assert WorkerSettings().worker_cross_targets == ["aarch64", "/some/node.json"]


def test_an_aarch64_target_gives_the_iree_key_of_a_plain_armv8_node(
        host: HardwareFingerprint, tmp_path: Path) -> None:
    found = cross_targets(["aarch64"], host)
    minor = ".".join(host.runtimes["iree"].split(".")[:2])
    assert list(found) == [f"iree-cpu-armv8-iree{minor}"]
    target = found[f"iree-cpu-armv8-iree{minor}"]
    assert target.cpu.arch == "aarch64" and target.source == "declared"
    # A fingerprint file declares one node exactly: its features are in its key.
    node = HardwareFingerprint(cpu=CpuInfo(arch="aarch64", features=["neon", "dotprod"]),
                               runtimes={"iree": host.runtimes["iree"]})
    (tmp_path / "node.json").write_text(node.model_dump_json())
    assert list(cross_targets([str(tmp_path / "node.json")], host)) == [
        f"iree-cpu-armv8-dotprod-iree{minor}"]


def test_bad_targets_are_refused_naming_what_is_accepted(host: HardwareFingerprint,
                                                        tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"neither an architecture \(\['aarch64'\]\)"):
        cross_targets(["riscv"], host)
    with pytest.raises(ConfigError, match="this worker's own architecture"):
        (tmp_path / "self.json").write_text(host.model_dump_json())
        cross_targets([str(tmp_path / "self.json")], host)
    without_iree = host.model_copy(update={"runtimes": {}})
    with pytest.raises(ConfigError, match="no backend here cross-compiles"):
        cross_targets(["aarch64"], without_iree)


def test_the_worker_advertises_and_builds_its_cross_keys(
        host: HardwareFingerprint, tmp_path: Path) -> None:
    runner = JobRunner(WorkerSettings(worker_cross_targets=["aarch64"], home=tmp_path),
                       builds=object())  # type: ignore[arg-type]  (no control plane asked)
    runner.fingerprint = host
    (key, target), = runner.cross_targets.items()
    assert runner.target_for(key) is target and runner.target_for("other") is host
    beat = Heartbeat(runner, [key])
    assert beat.formats[key] == ["onnx"] and beat.precisions[key] == ["fp32", "auto"]


def test_a_cross_build_is_deferred_to_the_node_with_golden_samples(
        host: HardwareFingerprint, tmp_path: Path) -> None:
    (key, target), = cross_targets(["aarch64"], host).items()
    assert runs_here(host) and not runs_here(target)
    model = mlp().SerializeToString()
    options = CompileOptions(backends=["iree"], tuning_budget_s=60)
    plan = plan_build(sha256_hex(model), options, target, key=key)
    result = compile_model(model, options, fingerprint=target, workdir=tmp_path, plan=plan)
    manifest = result.manifest
    assert manifest.fingerprint_key == key and manifest.backend == "iree"
    assert manifest.runtime_config["target_triple"] == "aarch64-linux-gnu"
    assert not manifest.verification.passed
    assert manifest.verification.deferred.startswith(DEFERRED_TO_NODE)
    assert manifest.benchmark.deferred and manifest.benchmark.p50_ms == 0.0
    assert manifest.requirements is not None and manifest.requirements.arch == "aarch64"
    table = manifest.tuning
    assert table is not None and table.winner == "iree/default" and table.rounds == 0
    assert [c.outcome for c in table.candidates[1:]] == [CandidateOutcome.SKIPPED] * (
        len(table.candidates) - 1)
    assert GOLDEN_BLOB in {ref.name for ref in manifest.blobs}
    assert set(result.blob_paths) == {ref.name for ref in manifest.blobs}
    assert all(path.is_file() for path in result.blob_paths.values())


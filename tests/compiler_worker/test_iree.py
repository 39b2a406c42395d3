"""The iree backend and its executor: keys and compatibility per target, a real x86 build
through the compile pipeline, a real aarch64 cross-compile that the x86 node refuses before
loading, typed refusals, and (marked ``emulated``) the cross-built module run by the executor
in an aarch64 Python under qemu-user, against the x86 engine's outputs."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest

from compiler_worker import backends
from compiler_worker.backends import IreeBackend
from compiler_worker.pipeline import compile_model, peers_for
from kiln.examples import mlp
from runtime_agent.executors import IreeExecutor, load_executor
from runtime_agent.executors.base import MANIFEST_FILENAME, blob_filename
from runtime_agent.fingerprint import detect_fingerprint
from schemas.errors import BackendUnavailable, FingerprintMismatch
from schemas.fingerprint import CpuInfo, HardwareFingerprint, RuntimeVersions
from schemas.manifest import ArtifactManifest, BlobRef
from schemas.options import CompileOptions, Precision

pytest.importorskip("iree.runtime")
pytest.importorskip("iree.compiler")

IREE = IreeBackend()
V2 = ["ssse3", "sse4_1", "sse4_2", "popcnt"]
V3 = [*V2, "avx", "avx2", "fma", "f16c", "bmi1", "bmi2"]
V4 = [*V3, "avx512f", "avx512cd", "avx512dq", "avx512bw", "avx512vl"]
FAST = {"tuning_budget_s": 60, "benchmark_iterations": 5}
CHECKOUT = Path(__file__).resolve().parents[2]


def fp(arch: str, features: list[str], iree: str = "3.13.0") -> HardwareFingerprint:
    return HardwareFingerprint(cpu=CpuInfo(arch=arch, features=features),
                               runtimes=RuntimeVersions(iree=iree))


@pytest.fixture(scope="module")
def here() -> HardwareFingerprint:
    fingerprint = detect_fingerprint()
    if not IREE.supports(fingerprint):
        pytest.skip("the iree backend does not support this machine")
    return fingerprint


def arm_of(here: HardwareFingerprint, features: list[str] | None = None) -> HardwareFingerprint:
    """A declared aarch64 node with this machine's IREE version."""
    return fp("aarch64", ["neon", "fp16", "dotprod"] if features is None else features,
              here.runtimes["iree"] or "")


def test_keys_name_the_target_and_plain_engines_run_on_every_class_above() -> None:
    v3, v4vnni = fp("x86_64", V3), fp("x86_64", [*V4, "avx512_vnni"])
    arm = fp("aarch64", ["neon", "dotprod", "i8mm"])
    assert IreeExecutor.fingerprint_key(v3) == "iree-cpu-x86-64-v3-iree3.13"
    assert IreeExecutor.fingerprint_key(v4vnni) == "iree-cpu-x86-64-v4-vnni-iree3.13"
    assert IreeExecutor.fingerprint_key(arm) == "iree-cpu-armv8-dotprod-i8mm-iree3.13"
    # A plain v3 engine runs on a v4 node; a v4+VNNI engine not on v3; none across arches.
    assert IreeExecutor.compatible(v3, v4vnni) and not IreeExecutor.compatible(v4vnni, v3)
    assert not IreeExecutor.compatible(v3, arm) and not IreeExecutor.compatible(arm, v3)
    assert "iree-cpu-x86-64-v3-iree3.13" in IreeExecutor.compatibility_keys(v4vnni)
    assert IreeExecutor.compatibility_key(v4vnni) is None
    assert IreeExecutor.compatibility_keys(arm) == ["iree-cpu-armv8-dotprod-iree3.13",
                                                    "iree-cpu-armv8-iree3.13"]
    assert IreeExecutor.portable_key(arm) == "iree-cpu-armv8-iree3.13"
    # Another IREE release is another key: its modules do not load here.
    assert not IreeExecutor.compatible(fp("x86_64", V3, "3.12.0"), v3)
    assert not IreeExecutor.supports(fp("x86_64", V3, iree=""))


def test_refuses_what_it_does_not_build() -> None:
    with pytest.raises(BackendUnavailable, match="fp32 engines only"):
        IREE.check_options(CompileOptions(precision=Precision.INT8))
    IREE.check_options(CompileOptions(precision=Precision.AUTO))
    names = [c.name for c in IREE.candidates(fp("x86_64", V3), CompileOptions())]
    assert names == ["iree/default", "iree/data-tiling", "iree/data-tiling-ukernels",
                     "iree/channels-last"]


def test_races_in_another_backend_s_tuning_only_when_named(here: HardwareFingerprint) -> None:
    ort = backends.get("onnxruntime")
    if not ort.supports(here):
        pytest.skip("no onnxruntime here")
    assert "iree" not in [b.name for b in peers_for(ort, here, CompileOptions())]
    named = CompileOptions(backends=["onnxruntime", "iree"])
    assert "iree" in [b.name for b in peers_for(ort, here, named)]


def test_builds_verifies_and_runs_an_engine_for_this_cpu(tmp_path: Path,
                                                         here: HardwareFingerprint) -> None:
    result = compile_model(mlp().SerializeToString(),
                           CompileOptions(backends=["iree"], **FAST),
                           fingerprint=here, workdir=tmp_path)
    manifest = result.manifest
    assert manifest.backend == "iree" and manifest.verification.passed
    assert manifest.fingerprint_key == IREE.fingerprint_key(here)
    config = manifest.runtime_config
    assert config["target_triple"] == "x86_64-linux-gnu" or here.cpu.arch != "x86_64"
    assert config["input_names"] == [s.name for s in manifest.inputs]
    table = {c.name for c in manifest.tuning.candidates}
    assert {"iree/default", "iree/data-tiling-ukernels"} <= table
    artifact = _artifact_dir(tmp_path / "artifact", manifest, result.blob_paths["engine"])
    executor = load_executor(artifact, manifest)
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    got = executor.run({manifest.inputs[0].name: x})[manifest.outputs[0].name]
    assert got.shape == (3, 16) and np.isfinite(got).all()


def test_cross_compiles_for_aarch64_and_an_x86_node_refuses_it_before_loading(
        tmp_path: Path, here: HardwareFingerprint) -> None:
    if here.cpu.arch != "x86_64":
        pytest.skip("checks an aarch64 engine refused on x86")
    manifest, engine = _cross_built(tmp_path, here)
    assert manifest.runtime_config["target_triple"] == "aarch64-linux-gnu"
    assert manifest.fingerprint_key == "iree-cpu-armv8-dotprod-fp16-iree" + \
        manifest.fingerprint_key.rsplit("-iree", 1)[1]
    assert b"aarch64" in engine.read_bytes() or b"AArch64" in engine.read_bytes()
    artifact = _artifact_dir(tmp_path / "artifact", manifest, engine)
    with pytest.raises(FingerprintMismatch, match=r"aarch64-linux-gnu.*this node is x86_64"):
        load_executor(artifact, manifest)


def test_a_module_of_another_release_or_wanting_features_is_refused(
        tmp_path: Path, here: HardwareFingerprint) -> None:
    result = compile_model(mlp().SerializeToString(),
                           CompileOptions(backends=["iree"], tune="off", **FAST),
                           fingerprint=here, workdir=tmp_path / "job")
    engine = result.blob_paths["engine"]
    other = result.manifest.model_copy(deep=True)
    other.runtime_config["iree_version"] = "2.9.0"
    with pytest.raises(FingerprintMismatch, match=r"compiled by IREE 2\.9"):
        load_executor(_artifact_dir(tmp_path / "a", other, engine), other)
    # A module compiled with an extension this CPU lacks: one of the x86 table's where this CPU
    # lacks one; on a CPU with them all, an extension no x86 CPU has (a forged manifest).
    from runtime_agent.executors.iree.executor import X86_TARGET_FEATURES, target_features

    has = set(target_features(here.cpu))
    lacking = sorted({short for short, _ in X86_TARGET_FEATURES.values()} - has) or ["i8mm"]
    wanting = result.manifest.model_copy(deep=True)
    wanting.runtime_config["cpu_features"] = sorted(has | {lacking[0]})
    with pytest.raises(FingerprintMismatch, match=rf"lacks \['{lacking[0]}'\]"):
        load_executor(_artifact_dir(tmp_path / "b", wanting, engine), wanting)


@pytest.mark.emulated
def test_the_cross_built_module_runs_under_qemu_as_the_x86_one(
        tmp_path: Path, here: HardwareFingerprint) -> None:
    root = os.environ.get("KILN_ARM64_ROOT")
    if not root or not (Path(root) / "usr/bin/python3.11").is_file():
        pytest.skip("no arm64 root: run deploy/arm64/make-root.sh and set KILN_ARM64_ROOT")
    # qemu-user shows the host's /proc/cpuinfo, so the emulated node detects no aarch64
    # feature: it is a plain armv8 node, and is served an armv8 engine.
    manifest, engine = _cross_built(tmp_path, here, features=["neon"])
    artifact = _artifact_dir(tmp_path / "artifact", manifest, engine)
    x = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    native = compile_model(mlp().SerializeToString(),
                           CompileOptions(backends=["iree"], tune="off", **FAST),
                           fingerprint=here, workdir=tmp_path / "native")
    native_dir = _artifact_dir(tmp_path / "native-artifact", native.manifest,
                               native.blob_paths["engine"])
    want = load_executor(native_dir, native.manifest).run(
        {native.manifest.inputs[0].name: x})[native.manifest.outputs[0].name]
    script = (
        "import json, sys, numpy as np, platform\n"
        "from pathlib import Path\n"
        "from runtime_agent.executors import load_executor\n"
        "from schemas.manifest import ArtifactManifest\n"
        "d = Path(sys.argv[1])\n"
        "m = ArtifactManifest.model_validate_json((d / 'manifest.json').read_text())\n"
        "out = load_executor(d, m).run({m.inputs[0].name: np.load(sys.argv[2])})\n"
        "np.save(sys.argv[3], out[m.outputs[0].name]); print(platform.machine())\n")
    run = subprocess.run([str(CHECKOUT / "deploy/arm64/python"), "-c", script, str(artifact),
                          str(tmp_path / "x.npy"), str(tmp_path / "y.npy")],
                         capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "aarch64"
    got = np.load(tmp_path / "y.npy")
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


# -- helpers --------------------------------------------------------------------------------

def _cross_built(tmp_path: Path, here: HardwareFingerprint,
                 features: list[str] | None = None) -> tuple[ArtifactManifest, Path]:
    """The x86 build's manifest with the engine and facts of an aarch64 cross-compile (the
    pipeline cannot verify such an engine here; the arm64 node's golden check does)."""
    host = compile_model(mlp().SerializeToString(),
                         CompileOptions(backends=["iree"], tune="off", **FAST),
                         fingerprint=here, workdir=tmp_path / "host")
    model = tmp_path / "m.onnx"
    onnx.save(mlp(), str(model))
    arm = arm_of(here, features)
    built = IREE.build(model, CompileOptions(backends=["iree"]), tmp_path / "cross",
                       fingerprint=arm)
    _, engine, media_type = built.blobs[0]
    manifest = host.manifest.model_copy(deep=True)
    manifest.build_fingerprint = arm
    manifest.fingerprint_key = IREE.fingerprint_key(arm)
    manifest.runtime_config = built.runtime_config
    manifest.blobs = [_ref("engine", engine, media_type)]
    return manifest, engine


def _ref(name: str, path: Path, media_type: str) -> BlobRef:
    import hashlib

    data = path.read_bytes()
    return BlobRef(name=name, sha256=hashlib.sha256(data).hexdigest(), size=len(data),
                   media_type=media_type)


def _artifact_dir(folder: Path, manifest: ArtifactManifest, engine: Path) -> Path:
    folder.mkdir(parents=True)
    ref = manifest.blob("engine")
    (folder / blob_filename(ref)).write_bytes(engine.read_bytes())
    (folder / MANIFEST_FILENAME).write_text(json.dumps(manifest.model_dump(mode="json")))
    return folder

"""The AOTInductor backend: candidates, refusals, the instruction check, and real builds.

Tests marked ``aotinductor`` compile C++ with Inductor (a minute or more each on two cores);
select them with ``-m aotinductor``, or leave them out with ``-m "not aotinductor"``.
"""

from __future__ import annotations

import shutil
import subprocess
import zipfile
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest

from artifact_store.digest import sha256_file
from compiler_worker import backends
from compiler_worker.backends import AOTInductorBackend, backend_for
from compiler_worker.backends.aotinductor.backend import (
    check_package_isa,
    forbidden_instructions,
    vector_settings,
)
from compiler_worker.worker import fingerprint_keys, model_formats
from kiln.examples import mlp
from runtime_agent.executors import blob_filename, load_executor
from runtime_agent.fingerprint import isa_class, older_variant
from schemas.errors import BackendUnavailable, CompileError, FingerprintMismatch
from schemas.fingerprint import HardwareFingerprint
from schemas.manifest import (
    ArtifactManifest,
    BenchmarkResult,
    BlobRef,
    TensorSpec,
    VerificationResult,
)
from schemas.options import CompileOptions, Precision
from tests.compiler_worker.test_backends import V3, V4, cpu_fp

AOTI = AOTInductorBackend()


def torch_fp(features: list[str], torch: str = "2.13.0+cpu") -> HardwareFingerprint:
    fp = cpu_fp(features)
    return fp.model_copy(update={"runtimes": {**fp.runtimes, "torch": torch}})


# -- registry, choice and candidates (no build) ---------------------------------------------

def test_registered_beside_onnxruntime_and_tensorrt_but_never_picked_by_default() -> None:
    assert backends.names() == ["tensorrt", "onnxruntime", "openvino", "aotinductor", "iree"]
    fp = torch_fp(V4)
    assert backend_for(fp, CompileOptions()).name == "onnxruntime"
    assert backend_for(fp, CompileOptions(backends=["aotinductor"])).name == "aotinductor"
    # Workers serve its queue, for torch.export models only.
    assert fingerprint_keys(fp)[::2] == ["ort-cpu-x86-64-v4-ort1.32", AOTI.fingerprint_key(fp)]
    # onnxruntime builds torch programs too (through the ONNX exporter).
    assert model_formats(fp) == {"ort-cpu-x86-64-v4-ort1.32": ["onnx", "torch-export"],
                                 AOTI.fingerprint_key(fp): ["torch-export"]}
    # A job names no backend: the model's format picks one, a converting backend last; a
    # job's key decides.
    assert backend_for(fp, CompileOptions(), model_format="torch-export").name == "aotinductor"
    assert backend_for(fp, CompileOptions(), "ort-cpu-x86-64-v4-ort1.32",
                       model_format="torch-export").name == "onnxruntime"
    assert backend_for(fp, CompileOptions(), model_format="onnx").name == "onnxruntime"
    with pytest.raises(BackendUnavailable, match="builds \\['torch-export'\\] models, not onnx"):
        backend_for(fp, CompileOptions(backends=["aotinductor"]), model_format="onnx")


def test_candidates_default_first_fp32_only() -> None:
    fp = torch_fp(V3)
    names = [c.name for c in AOTI.candidates(fp, CompileOptions())]
    assert names == ["aotinductor/default", "aotinductor/freezing", "aotinductor/max-autotune"]
    short = AOTI.candidates(fp, CompileOptions(tuning_budget_s=60))
    assert [c.name for c in short] == ["aotinductor/default", "aotinductor/freezing"]
    assert [c.name for c in AOTI.candidates(fp, CompileOptions(optimization_level=1))] == [
        "aotinductor/default"]
    auto = AOTI.candidates(fp, CompileOptions(precision="auto"))
    reduced = [c for c in auto if c.precision != "fp32"]
    assert {c.precision for c in reduced} == {"bf16", "fp16"}
    assert all("fp32" in c.skip for c in reduced)
    assert all(not c.skip for c in auto if c.precision == "fp32")


@pytest.mark.parametrize("options", [
    CompileOptions(precision=Precision.FP16), CompileOptions(precision=Precision.INT8),
    CompileOptions(portability="portable")])
def test_refused_options(options: CompileOptions) -> None:
    with pytest.raises(BackendUnavailable, match="aotinductor"):
        AOTI.check_options(options)


def test_an_onnx_model_fails_with_the_reason(tmp_path: Path, fingerprint) -> None:
    model = tmp_path / "model.onnx"
    model.write_bytes(mlp().SerializeToString())
    with pytest.raises(CompileError, match="converter to a torch program"):
        AOTI.build(model, CompileOptions(), tmp_path / "out",
                   candidate=AOTI.candidates(fingerprint, CompileOptions())[0])


def test_vector_settings_stay_within_the_level() -> None:
    assert vector_settings("x86-64-v3", set(V4)) == ("x86-64-v3", 256)
    assert vector_settings("x86-64-v2", set(V3)) == ("x86-64-v2", 0)
    assert vector_settings("x86-64", set(V3)) == ("x86-64", 0)
    assert vector_settings("x86-64-v4", set(V4)) == ("x86-64-v4", 512)
    # Inductor would add VNNI / AMX instructions to its AVX-512 kernels on such a host.
    assert vector_settings("x86-64-v4", {*V4, "avx512_vnni"}) == ("x86-64-v4", 256)
    with pytest.raises(BackendUnavailable, match="x86-64 levels"):
        vector_settings("armv8-sve", set())


_DISASSEMBLY = """
0000000000001120 <kernel>:
    1120:\tvmovups ymm0,YMMWORD PTR [rdi]
    1124:\tvfmadd231ps ymm0,ymm1,ymm2
    1128:\tpopcnt eax,edx
    112c:\tpshufb xmm0,xmm1
    1130:\tvpaddd zmm0{k1},zmm1,zmm2
    1136:\tvpternlogd ymm1,ymm2,ymm3,0xff
    113c:\tvpdpbusd zmm0,zmm1,zmm2
    1142:\ttileloadd tmm0,[rax+rbx*1]
    1148:\tvcvtps2ph xmm0,ymm1,0x4
    114e:\tmovaps xmm0,XMMWORD PTR [rsi]
    1152:\tcall   1030 <vmovups@plt>
"""


def test_forbidden_instructions_per_level() -> None:
    v4 = forbidden_instructions(_DISASSEMBLY, "x86-64-v4")
    assert set(v4) == {"vpdpbusd", "tileloadd"}  # VNNI and AMX are in no level
    v3 = forbidden_instructions(_DISASSEMBLY, "x86-64-v3")
    assert set(v3) == {"vpdpbusd", "tileloadd", "vpaddd (zmm0)", "vpternlogd"}
    v2 = forbidden_instructions(_DISASSEMBLY, "x86-64-v2")
    assert set(v2) - set(v3) == {"vmovups", "vfmadd231ps", "vcvtps2ph"}
    base = forbidden_instructions(_DISASSEMBLY, "x86-64")
    assert set(base) - set(v2) == {"popcnt", "pshufb"}
    assert forbidden_instructions("    1000:\tmovaps xmm0,xmm1\n    1004:\tret\n",
                                  "x86-64") == {}


# -- real builds ----------------------------------------------------------------------------

torch = pytest.importorskip("torch")


class TwoLayerMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    model = TwoLayerMLP().eval()
    program = torch.export.export(model, (torch.randn(4, 16),))
    path = tmp_path_factory.mktemp("program") / "mlp.pt2"
    torch.export.save(program, str(path))
    return path, model


def artifact(built, out: Path, fingerprint: HardwareFingerprint,
             key: str) -> tuple[Path, ArtifactManifest]:
    """Lay ``built`` out as an artifact directory, as the tuner does."""
    out.mkdir(parents=True)
    refs = []
    for name, path, media_type in built.blobs:
        ref = BlobRef(name=name, sha256=sha256_file(path)[0], size=Path(path).stat().st_size,
                      media_type=media_type)
        shutil.copyfile(path, out / blob_filename(ref))
        refs.append(ref)
    options = CompileOptions(backends=["aotinductor"])
    manifest = ArtifactManifest(
        artifact_id="a" * 32, model_sha256="0" * 64, options_digest=options.digest(),
        options=options, backend="aotinductor", fingerprint_key=key,
        compatibility_key=AOTI.compatibility_key(fingerprint, built.runtime_config),
        toolchain=built.toolchain, build_fingerprint=fingerprint, blobs=refs,
        inputs=[TensorSpec(name="x", dtype="float32", shape=[4, 16])],
        outputs=[TensorSpec(name="y", dtype="float32", shape=[4, 8])],
        runtime_config=dict(built.runtime_config),
        verification=VerificationResult(passed=True, samples=0, max_abs_error=0.0,
                                        max_rel_error=0.0, atol=0.0, rtol=0.0,
                                        reference="eager"),
        benchmark=BenchmarkResult(iterations=0, warmup=0, p50_ms=0.0, p90_ms=0.0, mean_ms=0.0,
                                  min_ms=0.0),
        created_at=datetime.now(UTC))
    return out, manifest


def disassemble(package: Path, scratch: Path) -> str:
    """``objdump -d -M intel`` of every shared library in an AOTInductor package."""
    text = []
    with zipfile.ZipFile(package) as archive:
        for index, member in enumerate(m for m in archive.namelist() if m.endswith(".so")):
            library = scratch / f"{index}.so"
            library.write_bytes(archive.read(member))
            text.append(subprocess.run(
                ["objdump", "-d", "--no-show-raw-insn", "-M", "intel", str(library)],
                capture_output=True, text=True, check=True).stdout)
    assert text, "the package holds no shared library"
    return "\n".join(text)


def test_a_torch_without_cpp_march_builds_no_cpu_package(exported, fingerprint, tmp_path,
                                                          monkeypatch) -> None:
    """Older torch releases have no ``cpp.march``: a CPU package could not be held to an
    x86-64 level, so the build is refused before anything compiles."""
    from compiler_worker.backends.aotinductor import backend as aotinductor

    monkeypatch.setattr(aotinductor, "_has_march_setting", lambda: False)
    path, _ = exported
    candidate = AOTI.candidates(fingerprint, CompileOptions())[0]
    with pytest.raises(BackendUnavailable, match=r"has no inductor setting cpp\.march"):
        AOTI.build(path, CompileOptions(), tmp_path / "build", fingerprint=fingerprint,
                   candidate=candidate)
    assert not (tmp_path / "build" / "engine.pt2").exists()


@pytest.fixture(scope="module")
def built_here(exported, tmp_path_factory, fingerprint):
    path, _ = exported
    candidate = AOTI.candidates(fingerprint, CompileOptions())[0]
    workdir = tmp_path_factory.mktemp("aoti-here")
    return AOTI.build(path, CompileOptions(), workdir / "build", fingerprint=fingerprint,
                      candidate=candidate), workdir


@pytest.mark.aotinductor
def test_build_and_run_matches_eager(exported, built_here, fingerprint) -> None:
    _, model = exported
    built, workdir = built_here
    level = isa_class(fingerprint.cpu)
    assert built.runtime_config["isa_class"] == level and not built.runtime_config["cross_built"]
    assert built.runtime_config["input_names"] == ["x"]
    assert built.toolchain.startswith("torch-2.")
    key = AOTI.fingerprint_key(fingerprint)
    assert key == f"aoti-cpu-{level}-torch{'.'.join(torch.__version__.split('.')[:2])}"
    directory, manifest = artifact(built, workdir / "artifact", fingerprint, key)
    executor = load_executor(directory, manifest)
    x = np.random.default_rng(0).standard_normal((4, 16), dtype=np.float32)
    got = executor.run({"x": x})["y"]
    with torch.no_grad():
        want = model(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # The agent refuses a package of another torch, or of a level above this CPU, unloaded.
    other_torch = manifest.build_fingerprint.model_copy(
        update={"runtimes": {**manifest.build_fingerprint.runtimes, "torch": "2.1.0"}})
    with pytest.raises(BackendUnavailable, match=r"built with torch 2\.1\.0; this node runs"):
        load_executor(directory, manifest.model_copy(update={"build_fingerprint": other_torch}))
    above = {**manifest.runtime_config, "isa_class": "x86-64-v4"}
    if level != "x86-64-v4":
        with pytest.raises(BackendUnavailable, match=f"kernels for x86-64-v4; this node's CPU "
                                                     f"is {level}"):
            load_executor(directory, manifest.model_copy(update={"runtime_config": above}))


@pytest.mark.aotinductor
def test_cross_build_for_the_level_below(exported, built_here, fingerprint, tmp_path) -> None:
    """An older variant declared on this host gets an engine without an instruction above
    its level, checked by disassembly; this host's own engine would not pass that check."""
    if isa_class(fingerprint.cpu) not in ("x86-64-v3", "x86-64-v4"):
        pytest.skip(f"this host is {isa_class(fingerprint.cpu)}; the test needs v3 or v4")
    path, model = exported
    variant = older_variant(fingerprint)
    level = isa_class(variant.cpu)
    candidate = AOTI.candidates(variant, CompileOptions())[0]
    built = AOTI.build(path, CompileOptions(), tmp_path / "build", fingerprint=variant,
                       candidate=candidate)
    assert built.runtime_config["isa_class"] == level and built.runtime_config["cross_built"]
    package = built.blobs[0][1]
    assert forbidden_instructions(disassemble(package, tmp_path), level) == {}
    assert check_package_isa(package, level) >= 1
    # The check can fail: the host's own engine holds instructions the lower level lacks.
    here_package = built_here[0].blobs[0][1]
    assert forbidden_instructions(disassemble(here_package, tmp_path), level)
    with pytest.raises(CompileError, match=f"targets {level}, but .* lacks"):
        check_package_isa(here_package, level)
    directory, manifest = artifact(built, tmp_path / "artifact", variant,
                                   AOTI.fingerprint_key(variant))
    x = np.random.default_rng(1).standard_normal((4, 16), dtype=np.float32)
    with torch.no_grad():
        want = model(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(load_executor(directory, manifest).run({"x": x})["y"], want,
                               rtol=1e-5, atol=1e-5)
    # A fingerprint above this host is refused before anything is compiled.
    above = fingerprint.model_copy(deep=True)
    above.cpu.features = sorted({*above.cpu.features, *V4})
    if isa_class(fingerprint.cpu) != "x86-64-v4":
        with pytest.raises(FingerprintMismatch, match="declares x86-64-v4"):
            AOTI.build(path, CompileOptions(), tmp_path / "above", fingerprint=above,
                       candidate=candidate)

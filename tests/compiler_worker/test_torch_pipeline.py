"""The pipeline with torch.export programs: dispatch by format, dynamic axes from profiles,
verification against the eager program, and a real AOTInductor build (marker
``aotinductor``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from compiler_worker.pipeline import compile_model, plan_build, write_artifact_dir
from compiler_worker.torch_program import EagerReference, load_program, prepare_program
from kiln.examples import mlp
from runtime_agent.executors import load_executor
from schemas.errors import InvalidModel, InvalidOptions
from schemas.options import CompileOptions, ShapeProfile
from tests.models.torch_programs import (
    evil_sample_inputs,
    kthvalue_archive,
    rewrite,
    save_program,
    tiny_mlp,
    tiny_mlp_archive,
)

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def pt2(tmp_path_factory) -> Path:
    return tiny_mlp_archive(tmp_path_factory.mktemp("program") / "tiny.pt2")


def test_onnxruntime_builds_a_program_verified_against_eager(pt2: Path, fingerprint,
                                                             tmp_path: Path) -> None:
    """The onnxruntime backend takes a torch program: exported to ONNX in the build step,
    built, and verified against the eager program (not against the exported ONNX)."""
    from compiler_worker.backends import get

    key = get("onnxruntime").fingerprint_key(fingerprint)
    options = CompileOptions(tune="off")
    plan = plan_build("0" * 64, options, fingerprint, key=key, model_format="torch-export")
    assert plan.backend.name == "onnxruntime"
    result = compile_model(pt2.read_bytes(), options, fingerprint=fingerprint,
                           workdir=tmp_path / "work", plan=plan)
    manifest = result.manifest
    assert manifest.backend == "onnxruntime" and manifest.verification.passed
    assert "eager ExportedProgram.module()" in manifest.verification.reference
    assert [s.name for s in manifest.inputs] == ["x"]
    directory = write_artifact_dir(result, tmp_path / "artifact")
    x = np.random.default_rng(3).standard_normal((4, 16), dtype=np.float32)
    got = load_executor(directory, manifest).run({"x": x})
    with torch.no_grad():
        want = tiny_mlp()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got[manifest.outputs[0].name], want, rtol=1e-5, atol=1e-5)


def test_an_op_the_onnx_exporter_cannot_translate(fingerprint, tmp_path: Path) -> None:
    """torch.kthvalue has no ONNX translation: the onnxruntime build fails with
    ``unsupported_operator`` naming ``aten::kthvalue``."""
    from compiler_worker.backends import get
    from schemas.errors import ErrorCode, UnsupportedOperator

    path = kthvalue_archive(tmp_path / "kth.pt2")
    key = get("onnxruntime").fingerprint_key(fingerprint)
    plan = plan_build("0" * 64, CompileOptions(), fingerprint, key=key,
                      model_format="torch-export")
    with pytest.raises(UnsupportedOperator, match="cannot translate op aten::kthvalue") as caught:
        compile_model(path.read_bytes(), CompileOptions(tune="off"), fingerprint=fingerprint,
                      workdir=tmp_path / "work", plan=plan)
    assert caught.value.code is ErrorCode.UNSUPPORTED_OPERATOR
    assert caught.value.details["op"] == "aten::kthvalue"
    assert caught.value.http_status == 422


def test_exporter_failures_name_the_op() -> None:
    from compiler_worker.backends.onnxruntime.backend import unexported_op

    inner = RuntimeError("No ONNX function found for <OpOverload(op='aten.kthvalue', "
                         "overload='default')>. Failure message: ...")
    outer = RuntimeError("Failed to convert the exported program to an ONNX model.")
    outer.__cause__ = inner
    assert unexported_op(outer) == "aten::kthvalue"
    assert unexported_op(RuntimeError("translating node %k = call_function["
                                      "target=torch.ops.aten.kthvalue.default]")) == \
        "aten::kthvalue"
    assert unexported_op(RuntimeError("out of memory")) is None


def test_an_onnx_model_is_refused_by_aotinductor(fingerprint, tmp_path: Path) -> None:
    from compiler_worker.backends import get

    key = get("aotinductor").fingerprint_key(fingerprint)
    plan = plan_build("0" * 64, CompileOptions(), fingerprint, key=key)
    with pytest.raises(InvalidOptions, match="onnx model; the aotinductor backend"):
        compile_model(mlp().SerializeToString(), CompileOptions(), fingerprint=fingerprint,
                      workdir=tmp_path, plan=plan)


def test_the_worker_checks_before_it_loads(pt2: Path, tmp_path: Path) -> None:
    evil = rewrite(pt2, tmp_path / "evil.pt2",
                   lambda m: evil_sample_inputs(m, tmp_path / "pwned"))
    with pytest.raises(InvalidModel, match="may only rebuild plain tensors"):
        load_program(evil)
    assert not (tmp_path / "pwned").exists()


def test_profiles_make_a_fixed_axis_dynamic(pt2: Path, tmp_path: Path) -> None:
    loaded = load_program(pt2)
    assert loaded.inputs[0].shape == [4, 16]
    options = CompileOptions(shapes={"x": ShapeProfile(min=[1, 16], opt=[4, 16],
                                                       max=[32, 16])})
    prepared = prepare_program(loaded, options, tmp_path / "prepared.pt2")
    assert prepared.dynamic_axes == {"x": [0]}
    batch = prepared.inputs[0].shape[0]
    assert isinstance(batch, str) and prepared.inputs[0].shape[1] == 16
    reference = EagerReference(prepared)
    x = np.random.default_rng(0).standard_normal((9, 16), dtype=np.float32)
    got = reference.run({"x": x})
    with torch.no_grad():
        want = tiny_mlp()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(next(iter(got.values())), want, rtol=1e-5, atol=1e-5)
    # No profile: the program is built as submitted.
    same = prepare_program(loaded, CompileOptions(), tmp_path / "same.pt2")
    assert same.dynamic_axes == {} and same.path.read_bytes() == pt2.read_bytes()


def test_a_profile_the_program_cannot_take(tmp_path: Path) -> None:
    class FixedBatch(torch.nn.Module):
        def forward(self, x):
            return x.reshape(4 * 16) * 2  # the batch size is baked into the code

    path = save_program(FixedBatch(), (torch.randn(4, 16),), tmp_path / "fixed.pt2")
    options = CompileOptions(shapes={"x": ShapeProfile(min=[1, 16], opt=[4, 16],
                                                       max=[8, 16])})
    with pytest.raises(InvalidOptions, match=r"dynamic axes \{'x': \[0\]\}, which the program "
                                             r"cannot take"):
        prepare_program(load_program(path), options, tmp_path / "p.pt2")


@pytest.mark.aotinductor
def test_compile_a_program_verified_against_eager(pt2: Path, fingerprint,
                                                  tmp_path: Path) -> None:
    options = CompileOptions(backends=["aotinductor"], tune="off")
    stages: list[str] = []
    result = compile_model(pt2.read_bytes(), options, fingerprint=fingerprint,
                           workdir=tmp_path / "work",
                           on_stage=lambda stage, _: stages.append(stage.value))
    manifest = result.manifest
    assert stages[:2] == ["loading", "checking"] and "verifying" in stages
    assert manifest.backend == "aotinductor"
    assert manifest.verification.passed and manifest.verification.samples == 3
    assert "eager ExportedProgram.module()" in manifest.verification.reference
    assert manifest.tuning is not None and manifest.tuning.winner == "aotinductor/default"
    assert [s.name for s in manifest.inputs] == ["x"]
    directory = write_artifact_dir(result, tmp_path / "artifact")
    x = np.random.default_rng(3).standard_normal((4, 16), dtype=np.float32)
    got = load_executor(directory, manifest).run({"x": x})
    with torch.no_grad():
        want = tiny_mlp()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got[manifest.outputs[0].name], want, rtol=1e-5, atol=1e-5)


@torch.library.custom_op("kilntest::scale", mutates_args=())
def _scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor


@_scale.register_fake
def _(x: torch.Tensor, factor: float) -> torch.Tensor:
    return torch.empty_like(x)


class UsesCustomOp(torch.nn.Module):
    def forward(self, x):
        return torch.ops.kilntest.scale(torch.relu(x), 3.0) + 1.0


def test_an_op_the_candidate_cannot_lower_is_named(tmp_path: Path, fingerprint) -> None:
    """Inductor without implicit fallbacks has no lowering for a custom op: the candidate
    fails naming the op (a real Inductor failure, raised before any C++ is compiled)."""
    from compiler_worker.backends import AOTInductorBackend
    from compiler_worker.backends.base import Candidate
    from schemas.errors import CompileError

    path = save_program(UsesCustomOp(), (torch.randn(2, 5),), tmp_path / "op.pt2")
    strict = Candidate(name="aotinductor/strict", config={"implicit_fallbacks": False})
    with pytest.raises(CompileError, match=r"cannot lower op kilntest\.scale\.default") as caught:
        AOTInductorBackend().build(path, CompileOptions(), tmp_path / "build",
                                   fingerprint=fingerprint, candidate=strict)
    assert caught.value.details["op"] == "kilntest.scale.default"


@pytest.mark.aotinductor
def test_the_job_goes_on_with_the_other_candidates(tmp_path: Path, fingerprint,
                                                   example_bundles) -> None:
    """A candidate that cannot lower an op (the plugin's Swish, without Inductor's implicit
    fallbacks) is recorded as failed with the op named; the default candidate still builds,
    verifies and wins."""
    from compiler_worker import backends
    from compiler_worker.backends import AOTInductorBackend
    from compiler_worker.backends.base import Candidate
    from runtime_agent.executors.aotinductor.custom_ops import TorchCustomOps
    from runtime_agent.plugins import load_bundle

    class StrictFirst(AOTInductorBackend):
        """The real backend; the test only puts a no-fallback candidate before the default."""

        def candidates(self, fingerprint, options):
            default = super().candidates(fingerprint, options)[0]
            return [Candidate(name="aotinductor/strict", config={"implicit_fallbacks": False}),
                    default]

    swish = example_bundles.swish
    plugin = load_bundle(swish.archive, swish.ref, tmp_path / "author", target=("torch", "cpu"))
    TorchCustomOps.resolve([plugin], {"kiln.examples::Swish"}).apply()

    class UsesSwish(torch.nn.Module):
        def forward(self, x):
            return torch.ops.kiln_examples.Swish(x * 2.0, beta=1.5)

    path = save_program(UsesSwish(), (torch.randn(2, 5),), tmp_path / "op.pt2")
    real = backends.get("aotinductor")
    backends.register("aotinductor", StrictFirst(), replace=True)
    try:
        result = compile_model(path.read_bytes(), CompileOptions(backends=["aotinductor"]),
                               fingerprint=fingerprint, workdir=tmp_path / "work",
                               plugins=[swish.plugin])
    finally:
        backends.register("aotinductor", real, replace=True)
    table = {c.name: c for c in result.manifest.tuning.candidates}
    assert table["aotinductor/strict"].outcome.value == "failed_build"
    assert "cannot lower op kiln_examples.Swish.default" in table["aotinductor/strict"].reason
    assert result.manifest.tuning.winner == "aotinductor/default"
    assert result.manifest.verification.passed

"""The OpenVINO backend: candidates by precision policy and CPU, real builds of small models
(ONNX and torch.export) through the compile pipeline, NNCF int8 under the accuracy gate, and
the typed refusals (an op OpenVINO cannot convert, a declared CPU it cannot compile for, too
few calibration samples)."""

from __future__ import annotations

import io
import tempfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from compiler_worker import backends
from compiler_worker.backends import OpenVinoBackend, backend_for
from compiler_worker.backends.openvino.backend import onnx_op_names, unconverted_ops
from compiler_worker.pipeline import compile_model, peers_for
from kiln.examples import mlp, small_cnn
from runtime_agent.executors.openvino.executor import has_bf16, kernel_features
from runtime_agent.fingerprint import detect_fingerprint, older_variant
from schemas.datasets import NNCF_MIN_CALIBRATION_SAMPLES, check_nncf_calibration
from schemas.errors import (
    AccuracyGateFailed,
    BackendUnavailable,
    FingerprintMismatch,
    InvalidOptions,
    NoViableCandidate,
    UnsupportedOperator,
)
from schemas.fingerprint import CpuInfo, HardwareFingerprint, RuntimeVersions
from schemas.options import AccuracyGate, AccuracyMetric, CompileOptions, Portability, Precision
from schemas.tuning import CandidateOutcome

ov = pytest.importorskip("openvino")

OV = OpenVinoBackend()
V4 = ["ssse3", "sse4_1", "sse4_2", "popcnt", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2",
      "avx512f", "avx512cd", "avx512dq", "avx512bw", "avx512vl"]
SPR = [*V4, "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"]
FAST = {"tuning_budget_s": 60, "benchmark_iterations": 5}


def fp(features: list[str]) -> HardwareFingerprint:
    return HardwareFingerprint(cpu=CpuInfo(arch="x86_64", features=features),
                               runtimes=RuntimeVersions(onnxruntime="1.32.0",
                                                        openvino="2026.4.1"))


@pytest.fixture(scope="module")
def here() -> HardwareFingerprint:
    fingerprint = detect_fingerprint()
    if not OV.supports(fingerprint):
        pytest.skip("OpenVINO does not support this machine")
    return fingerprint


def names(found) -> list[str]:
    return [c.name for c in found]


def test_candidates_follow_the_precision_policy_and_the_cpu() -> None:
    fp32 = OV.candidates(fp(SPR), CompileOptions())
    assert names(fp32) == ["openvino/fp32-latency", "openvino/fp32-throughput"]
    assert all(c.exact and not c.skip for c in fp32)
    auto = {c.name: c for c in OV.candidates(fp(SPR), CompileOptions(precision=Precision.AUTO))}
    assert auto["openvino/bf16-latency"].precision == "bf16"
    assert not auto["openvino/bf16-latency"].skip
    ptq, control = auto["openvino/int8-ptq"], auto["openvino/int8-accuracy-control"]
    assert ptq.needs_calibration and control.needs_calibration
    assert control.fallback_of == ptq.name and not ptq.fallback_of
    # Where neither AMX-BF16 nor AVX-512 BF16 is there, bf16 is recorded as skipped.
    plain = {c.name: c for c in OV.candidates(fp([*V4, "avx512_vnni"]),
                                              CompileOptions(precision=Precision.AUTO))}
    assert "neither AMX-BF16 nor AVX-512 BF16" in plain["openvino/bf16-latency"].skip
    assert plain["openvino/int8-ptq"].config["inference_precision"] == "f32"
    assert auto["openvino/int8-ptq"].config["inference_precision"] == "bf16"
    # The budget bounds the accuracy restorer's rounds.
    short = OV.candidates(fp(SPR), CompileOptions(precision=Precision.INT8, tuning_budget_s=10))
    assert [c.config["accuracy_control_iterations"] for c in short
            if c.name.endswith("accuracy-control")] == [1]


def test_refuses_what_it_cannot_build() -> None:
    with pytest.raises(BackendUnavailable, match="no fp16"):
        OV.check_options(CompileOptions(precision=Precision.FP16))
    with pytest.raises(BackendUnavailable, match="no portable engines"):
        OV.check_options(CompileOptions(portability=Portability.PORTABLE))


def test_a_job_without_a_key_or_a_name_goes_to_onnxruntime_first() -> None:
    """OpenVINO never takes a job on its own unless named: its candidates race onnxruntime's
    inside onnxruntime's job (as a peer) instead of making a second one."""
    assert backends.get("openvino") is not None
    assert backend_for(fp(SPR), CompileOptions()).name == "onnxruntime"
    assert backend_for(fp(SPR), CompileOptions(), model_format="onnx").name == "onnxruntime"
    pinned = backend_for(fp(SPR), CompileOptions(backends=["openvino"]), model_format="onnx")
    assert pinned is backends.get("openvino")
    key = OV.fingerprint_key(fp(SPR))
    assert backend_for(fp(SPR), CompileOptions(), key, model_format="onnx").name == "openvino"
    ort = backends.get("onnxruntime")
    assert [p.name for p in peers_for(ort, fp(SPR), CompileOptions(), "onnx")] == ["openvino"]
    # tune: off builds the named backend's default only, so no peers then.
    assert peers_for(ort, fp(SPR), CompileOptions(tune="off"), "onnx") == ()


def test_names_the_ops_its_front_end_reports() -> None:
    message = ("Model wasn't fully converted.\nSummary:\n-- No conversion rule found for "
               "operations: Det-18, custom.dom.MyOp\n")
    assert unconverted_ops(message) == ["Det-18", "custom.dom.MyOp"]
    assert unconverted_ops("something else") == []
    nodes = [helper.make_node("Det", ["x"], ["y"]),
             helper.make_node("MyOp", ["y"], ["z"], domain="custom.dom")]
    graph = helper.make_graph(nodes, "g", [], [])
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "m.onnx"
        onnx.save(helper.make_model(graph), str(path))
        assert onnx_op_names(path, ["Det-18", "custom.dom.MyOp"]) == \
            ["ai.onnx::Det", "custom.dom::MyOp"]


def det_model() -> onnx.ModelProto:
    """Determinants of a batch of 3x3 matrices: onnxruntime runs ``Det``; OpenVINO's ONNX
    front end has no rule for it."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    graph = helper.make_graph([helper.make_node("Det", ["x"], ["y"])], "det", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def test_an_op_openvino_cannot_convert_is_typed_and_onnxruntime_still_wins(
        tmp_path: Path, here: HardwareFingerprint) -> None:
    path = tmp_path / "det.onnx"
    onnx.save(det_model(), str(path))
    with pytest.raises(UnsupportedOperator, match=r"ai\.onnx::Det") as refused:
        OV.build(path, CompileOptions(), tmp_path / "build", fingerprint=here)
    assert refused.value.details["op"] == "ai.onnx::Det"
    assert refused.value.details["backend"] == "openvino"
    # In one tuning run with onnxruntime (the job names no backend), OpenVINO's candidates fail
    # with that reason and onnxruntime's engine is published.
    result = compile_model(det_model().SerializeToString(), CompileOptions(**FAST),
                           fingerprint=here, workdir=tmp_path / "job")
    table = {c.name: c for c in result.manifest.tuning.candidates}
    assert result.manifest.backend == "onnxruntime"
    assert table["openvino/fp32-latency"].outcome is CandidateOutcome.FAILED_BUILD
    assert "ai.onnx::Det" in table["openvino/fp32-latency"].reason


def test_builds_verifies_and_exports_an_fp32_engine(tmp_path: Path,
                                                    here: HardwareFingerprint) -> None:
    result = compile_model(mlp().SerializeToString(),
                           CompileOptions(backends=["openvino"], **FAST),
                           fingerprint=here, workdir=tmp_path)
    manifest = result.manifest
    assert manifest.backend == "openvino" and manifest.precision == "fp32"
    assert manifest.fingerprint_key == OV.fingerprint_key(here)
    assert manifest.verification.passed
    config = manifest.runtime_config
    assert config["properties"]["INFERENCE_PRECISION_HINT"] == "f32"
    assert config["openvino_version"] == OV.executor.probe_version()
    assert config["cpu_features"] == kernel_features(here.cpu)
    assert config["cpu_isa"]  # what OpenVINO wrote into the blob's header
    blob = result.blob_paths["engine"].read_bytes()
    assert f"ov={config['openvino_version']}".encode() in blob[:4096]
    table = {c.name: c.outcome for c in manifest.tuning.candidates}
    assert set(table) == {"openvino/fp32-latency", "openvino/fp32-throughput"}
    # Both verified element-wise: fp32 is asked for, not left to the plugin's default (bf16
    # on a CPU with AMX or AVX-512 BF16).
    assert set(table.values()) <= {CandidateOutcome.WON, CandidateOutcome.SLOWER}, table


def test_builds_a_torch_export_program(tmp_path: Path, here: HardwareFingerprint) -> None:
    pytest.importorskip("torch")
    import torch

    from tests.models.torch_programs import save_program, tiny_mlp

    path = save_program(tiny_mlp(), (torch.randn(2, 16),), tmp_path / "p.pt2")
    result = compile_model(path.read_bytes(), CompileOptions(backends=["openvino"], **FAST),
                           fingerprint=here, workdir=tmp_path / "job")
    manifest = result.manifest
    assert manifest.backend == "openvino" and manifest.verification.passed
    assert manifest.runtime_config["input_names"] == [spec.name for spec in manifest.inputs]
    assert manifest.runtime_config["output_names"] == [spec.name for spec in manifest.outputs]


def test_a_declared_cpu_it_cannot_compile_for_is_refused(tmp_path: Path,
                                                         here: HardwareFingerprint) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(mlp(), str(path))
    try:
        declared = older_variant(here)
    except ValueError:
        pytest.skip("no older x86-64 level to declare on this machine")
    with pytest.raises(FingerprintMismatch, match="compiles for the CPU it runs on"):
        OV.build(path, CompileOptions(), tmp_path / "build", fingerprint=declared)
    other = here.model_copy(update={"runtimes": {**here.runtimes, "openvino": "2020.1.0"}})
    with pytest.raises(FingerprintMismatch, match=r"declares OpenVINO 2020\.1\.0"):
        OV.build(path, CompileOptions(), tmp_path / "build2", fingerprint=other)


def samples_for(model: onnx.ModelProto, n: int) -> dict[str, np.ndarray]:
    spec = model.graph.input[0]
    shape = [d.dim_value or 1 for d in spec.type.tensor_type.shape.dim]
    return {spec.name: np.random.default_rng(0).standard_normal((n, *shape)).astype(np.float32)}


def test_reduced_precision_candidates_pass_the_gate(tmp_path: Path,
                                                    here: HardwareFingerprint) -> None:
    model = small_cnn(batch=1)
    result = compile_model(
        model.SerializeToString(),
        CompileOptions(backends=["openvino"], precision=Precision.AUTO, **FAST),
        fingerprint=here, workdir=tmp_path,
        samples=samples_for(model, NNCF_MIN_CALIBRATION_SAMPLES))
    table = {c.name: c for c in result.manifest.tuning.candidates}
    ptq = table["openvino/int8-ptq"]
    assert ptq.outcome in (CandidateOutcome.WON, CandidateOutcome.SLOWER), ptq.reason
    assert ptq.accuracy is not None and ptq.accuracy >= 0.99
    # PTQ met the gate, so accuracy control was not needed.
    assert table["openvino/int8-accuracy-control"].outcome is CandidateOutcome.SKIPPED
    bf16 = table["openvino/bf16-latency"]
    if has_bf16(here.cpu):
        assert bf16.outcome in (CandidateOutcome.WON, CandidateOutcome.SLOWER), bf16.reason
        assert bf16.accuracy is not None and bf16.accuracy >= 0.99
    else:
        assert bf16.outcome is CandidateOutcome.SKIPPED


def _int8_past_any_gate_options(tuning_budget_s: float) -> CompileOptions:
    """OpenVINO int8 only, under a gate no int8 engine of ``small_cnn`` meets."""
    return CompileOptions(
        backends=["openvino"], precision=Precision.INT8, tuning_budget_s=tuning_budget_s,
        benchmark_iterations=5,
        accuracy=AccuracyGate(metric=AccuracyMetric.MAX_ABS, threshold=1e-7))


def _int8_past_any_gate(tmp_path: Path, here: HardwareFingerprint, *,
                        tuning_budget_s: float) -> dict[str, dict]:
    """The candidate rows of a job that fails typed: its int8 candidates cannot meet the gate."""
    model = small_cnn(batch=1)
    with pytest.raises(AccuracyGateFailed) as failed:
        compile_model(model.SerializeToString(), _int8_past_any_gate_options(tuning_budget_s),
                      fingerprint=here, workdir=tmp_path,
                      samples=samples_for(model, NNCF_MIN_CALIBRATION_SAMPLES))
    return {r["name"]: r for r in failed.value.details["tuning"]["candidates"]}


def test_accuracy_control_runs_when_ptq_misses_the_gate(tmp_path: Path,
                                                        here: HardwareFingerprint) -> None:
    """A gate no int8 engine meets on this model: PTQ misses it, so NNCF's accuracy-aware
    quantization is built and judged too (it reverts layers to floating point until the
    restorer's rounds run out; it cannot meet this gate either, but it must have been
    tried), and the job fails typed with the table."""
    rows = _int8_past_any_gate(tmp_path, here, tuning_budget_s=30)
    assert rows["openvino/int8-ptq"]["outcome"] == CandidateOutcome.FAILED_ACCURACY.value
    control = rows["openvino/int8-accuracy-control"]
    assert control["outcome"] == CandidateOutcome.FAILED_ACCURACY.value, control["reason"]
    assert control["accuracy"] is not None


def test_too_few_calibration_samples(tmp_path: Path, here: HardwareFingerprint) -> None:
    pinned = CompileOptions(backends=["openvino"], precision=Precision.AUTO)
    with pytest.raises(InvalidOptions, match=f"at least {NNCF_MIN_CALIBRATION_SAMPLES}") as e:
        check_nncf_calibration(pinned, NNCF_MIN_CALIBRATION_SAMPLES - 1, dataset_id="d",
                               role="calibration")
    assert e.value.http_status == 422
    assert e.value.details["minimum"] == NNCF_MIN_CALIBRATION_SAMPLES
    check_nncf_calibration(pinned, NNCF_MIN_CALIBRATION_SAMPLES, dataset_id="d",
                           role="calibration")
    # Where other backends build too, or no int8 is allowed, the submit is not refused.
    check_nncf_calibration(CompileOptions(precision=Precision.AUTO), 2, dataset_id="d",
                           role="calibration")
    check_nncf_calibration(pinned.model_copy(update={"precision": Precision.BF16}), 2,
                           dataset_id="d", role="calibration")
    # A build that gets fewer anyway fails these candidates with the minimum named.
    model = small_cnn(batch=1)
    with pytest.raises(NoViableCandidate) as failed:
        compile_model(model.SerializeToString(),
                      CompileOptions(backends=["openvino"], precision=Precision.INT8, **FAST),
                      fingerprint=here, workdir=tmp_path, samples=samples_for(model, 4))
    rows = failed.value.details["tuning"]["candidates"]
    ptq = next(r for r in rows if r["name"] == "openvino/int8-ptq")
    assert f"at least {NNCF_MIN_CALIBRATION_SAMPLES}" in ptq["reason"]


def test_custom_ops_are_refused_typed_and_leave_openvino_out(
        example_bundles, tmp_path: Path, here: HardwareFingerprint) -> None:
    """No plugin bundle carries an OpenVINO extension yet: a job that names only this backend
    for a model with custom ops fails with ``NoImplementation`` naming the backend and the ops;
    a job that names none builds with onnxruntime, OpenVINO's candidates not built."""
    from runtime_agent.plugins import NoImplementation
    from tests.plugins.helpers import models

    swish = example_bundles.swish
    data = models.swish_cnn().SerializeToString()
    with pytest.raises(NoImplementation, match="openvino") as refused:
        compile_model(data, CompileOptions(backends=["openvino"], **FAST), fingerprint=here,
                      workdir=tmp_path / "pinned", plugins=[swish.plugin])
    assert "kiln.examples::Swish" in refused.value.message
    result = compile_model(data, CompileOptions(**FAST), fingerprint=here,
                           workdir=tmp_path / "any", plugins=[swish.plugin])
    assert result.manifest.backend == "onnxruntime"
    built = [c for c in result.manifest.tuning.candidates if c.name.startswith("openvino/")
             and c.outcome in (CandidateOutcome.WON, CandidateOutcome.SLOWER)]
    assert built == []


def test_builds_in_the_workers_sandbox(tmp_path: Path, here: HardwareFingerprint) -> None:
    """As a worker builds: in the bounded child with no credentials, no home and a scratch
    folder only; OpenVINO compiles and NNCF quantizes there too."""
    from artifact_store.sandbox import Limits
    from compiler_worker.pipeline import plan_build
    from compiler_worker.sandbox import Sandbox
    from schemas._canonical import sha256_hex

    model = small_cnn(batch=1)
    options = CompileOptions(backends=["openvino"], precision=Precision.INT8, **FAST)
    plan = plan_build(sha256_hex(model.SerializeToString()), options, here)
    npz = io.BytesIO()
    np.savez(npz, **samples_for(model, NNCF_MIN_CALIBRATION_SAMPLES))
    result = Sandbox(Limits(address_space_bytes=8 << 30, wall_s=300)).compile_model(
        model.SerializeToString(), options, fingerprint=here, workdir=tmp_path, plan=plan,
        samples=npz.getvalue())
    assert result.manifest.backend == "openvino"
    assert result.manifest.precision == "int8-ptq"
    assert result.manifest.runtime_config["quantization"]["method"] == "nncf.quantize"
    # The child's home (its scratch folder) held OpenVINO telemetry's opt-out, so the build
    # wrote no client id or usage counts beside it.
    home = sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "intel").rglob("*")
                  if p.is_file())
    assert home == ["intel/openvino_telemetry"]


def test_accuracy_control_stops_at_the_tuning_budget(tmp_path: Path,
                                                     here: HardwareFingerprint) -> None:
    """NNCF's accuracy restorer runs round after round; its length cannot be predicted from
    the builds before it, so it gets what is left of the budget as a deadline and stops there,
    recorded over_budget (without the deadline it runs its rounds to the end)."""
    from compiler_worker.backends.base import BuildDeadline, build_deadline

    rows = _int8_past_any_gate(tmp_path, here, tuning_budget_s=0.5)
    model, options = small_cnn(batch=1), _int8_past_any_gate_options(0.5)
    # The first build is never bounded: PTQ ran to its end (and missed this gate).
    assert rows["openvino/int8-ptq"]["outcome"] == CandidateOutcome.FAILED_ACCURACY.value
    control = rows["openvino/int8-accuracy-control"]
    assert control["outcome"] == CandidateOutcome.OVER_BUDGET.value, control["reason"]
    assert "deadline" in control["reason"] and "0.5 s" in control["reason"]

    # The backend itself: under a deadline already past, the restorer's first validation
    # stops the build, typed; unbounded, the same build completes.
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    candidate = next(c for c in OV.candidates(here, options)
                     if c.name.endswith("accuracy-control"))
    calibration = [{k: v[i] for k, v in
                    samples_for(model, NNCF_MIN_CALIBRATION_SAMPLES).items()}
                   for i in range(NNCF_MIN_CALIBRATION_SAMPLES)]
    lenient = options.model_copy(update={"accuracy": AccuracyGate(
        metric=AccuracyMetric.COSINE, threshold=0.9)})
    with build_deadline(0.0), pytest.raises(BuildDeadline):
        OV.build(path, lenient, tmp_path / "b1", fingerprint=here, candidate=candidate,
                 calibration=calibration)
    built = OV.build(path, lenient, tmp_path / "b2", fingerprint=here, candidate=candidate,
                     calibration=calibration)
    assert built.runtime_config["quantization"]["method"] == \
        "nncf.quantize_with_accuracy_control"

"""The compile pipeline as plain functions: bytes and options in, a verified engine out.

Stages, reported through ``on_stage(stage, progress)`` as they start: LOADING, CHECKING (the
``check`` pass), OPTIMIZING (the graph passes), BUILDING (the backend), VERIFYING (the engine,
run by its executor twin exactly as agents will run it, against the reference), BENCHMARKING.
Publishing is the caller's: ``compile_model`` writes nothing outside ``workdir``.

Custom ops. ``compile_model(..., plugins=[(PluginRef, bundle archive), ...])`` unpacks and
loads each bundle (verified against its ref) for the target backend and device, refuses a
model whose custom ops (nodes outside ``schemas.onnx_model.BUILTIN_DOMAINS``) no plugin declares
(``UnknownOperator``) or whose plugin has no implementation for the target
(``NoImplementation``), writes the ops' attribute defaults into the graph, infers their outputs
with the shape functions (the ``custom_op_shapes`` pass), builds and verifies with the kernels
registered in both the engine's and the reference's sessions, and records the plugins that
provide the model's ops in ``manifest.plugins``. Their digests are part of the toolchain
string, hence of the artifact id: a new plugin version makes a new artifact.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

import numpy as np

from compiler_worker import backends
from compiler_worker.artifact_dir import (
    PLUGINS_DIRNAME,
    CompileResult,
    fresh_dir,
    write_artifact_dir,
)
from compiler_worker.backends.base import PIPELINE_VERSION, Backend, BuiltEngine, Candidate
from compiler_worker.benchmark import benchmark, host_lock
from compiler_worker.cross_build import cross_build, runs_here
from compiler_worker.golden import add_golden
from compiler_worker.inputs import generated_inputs_source, input_ranges
from compiler_worker.modelio import load_model, materialize_model, save_model, signature
from compiler_worker.passes import default_pipeline
from compiler_worker.passes.custom_op_shapes import fill_attribute_defaults
from compiler_worker.plan import (
    BuildPlan,
    artifact_id_for,
    compose_toolchain,
    peers_for,
    plan_build,
    plugins_tag,
)
from compiler_worker.plugin_prep import UsedPlugins, peer_custom_ops, prepare_plugins
from compiler_worker.tuner import tune
from compiler_worker.verify import random_inputs
from runtime_agent.executors import blob_filename
from runtime_agent.samples import describe_inputs
from schemas._canonical import sha256_hex
from schemas.errors import CompileError, InvalidOptions
from schemas.fingerprint import HardwareFingerprint
from schemas.jobs import JobStage
from schemas.manifest import ArtifactManifest, BenchmarkResult, TensorSpec, VerificationResult
from schemas.onnx_model import custom_ops
from schemas.options import CompileOptions, ShapeProfile
from schemas.plugins import PluginRef
from schemas.torch_export import TORCH_EXPORT_FORMAT, model_format
from schemas.tuning import TuningTable

# The plan, the plugins' preparation, the cross build and the artifact directory live in their
# own modules; their public names stay importable from here, the pipeline's one entry point.
__all__ = [
    "PIPELINE_VERSION",
    "PLUGINS_DIRNAME",
    "BuildPlan",
    "CompileResult",
    "CustomOpsFound",
    "StageCallback",
    "artifact_id_for",
    "compile_model",
    "dataset_feeds",
    "peers_for",
    "plan_build",
    "plugins_tag",
    "runs_here",
    "write_artifact_dir",
]


class CustomOpsFound(Exception):
    """The model uses the custom ops ``ops`` (``domain::OpType``) and ``compile_model`` was
    given ``plugins=None``: it built nothing. The caller looks up the plugins that provide
    them and compiles again with those."""

    def __init__(self, ops: set[str]) -> None:
        super().__init__(f"the model uses custom ops: {', '.join(sorted(ops))}")
        self.ops = ops

logger = logging.getLogger(__name__)

StageCallback = Callable[[JobStage, float], None]

#: Overall progress when each stage starts.
STAGE_PROGRESS = {
    JobStage.LOADING: 0.0,
    JobStage.CHECKING: 0.05,
    JobStage.OPTIMIZING: 0.15,
    JobStage.BUILDING: 0.25,
    JobStage.VERIFYING: 0.6,
    JobStage.BENCHMARKING: 0.8,
}
_STAGE_ORDER = list(STAGE_PROGRESS)


class _Reference(Protocol):
    """What verification runs against: onnxruntime on the submitted ONNX model, or a torch
    program's eager module."""

    name: str

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...


class _Stages:
    """Reports each stage once, in order."""

    def __init__(self, callback: StageCallback | None) -> None:
        self.callback = callback
        self.current: JobStage | None = None

    def enter(self, stage: JobStage) -> None:
        if self.current is not None and _STAGE_ORDER.index(stage) <= _STAGE_ORDER.index(
            self.current
        ):
            return
        self.current = stage
        logger.info("stage %s", stage.value)
        if self.callback is not None:
            self.callback(stage, STAGE_PROGRESS[stage])


def compile_model(
    model_bytes: bytes,
    options: CompileOptions,
    *,
    fingerprint: HardwareFingerprint,
    workdir: Path,
    on_stage: StageCallback | None = None,
    disabled_passes: frozenset[str] = frozenset(),
    plugins: Sequence[tuple[PluginRef, Path]] | None = (),
    plan: BuildPlan | None = None,
    samples: Mapping[str, np.ndarray] | None = None,
    calibration: Mapping[str, np.ndarray] | None = None,
    reuse: TuningTable | None = None,
    benchmark_lock: Path | None = None,
) -> CompileResult:
    """Compile ONNX bytes into the fastest verified engine for hardware like ``fingerprint``.

    ``fingerprint`` is the build host's; the caller makes sure it describes this machine.
    ``plan``: the job's ``plan_build`` (computed here when absent). ``plugins``: (ref, bundle
    archive) of the plugins that may provide the model's custom ops (those that do are
    recorded in the manifest; others are ignored); ``None``: none were looked up, and a model
    that uses custom ops raises ``CustomOpsFound`` once they are known, before any build (a
    worker fetches plugins only for the models that need them, and parses the model once).
    ``samples`` / ``calibration``: the arrays of the datasets ``options.samples`` /
    ``options.calibration`` name (sample ``i`` of input ``x`` is ``samples["x"][i]``);
    without samples, inputs are generated to fit the graph.
    ``reuse``: an earlier tuning record for the same cache key (only its winner is built).
    ``benchmark_lock``: the host-wide lock file every timing waits for (default: the host's,
    ``compiler_worker.benchmark.default_lock_path``).

    Raises ``InvalidModel``, ``ModelCheckFailed``, ``UnsupportedOpset``, ``InvalidOptions``,
    ``BackendUnavailable``, ``UnknownOperator``, ``PluginError`` (``NoImplementation``,
    ``AbiMismatch``, ``ShapeFunctionError``), ``CustomOpsFound``, ``IntegrityError`` (a bundle
    that does not match its ref), ``CompileError``, ``VerificationFailed``,
    ``AccuracyGateFailed`` or ``NoViableCandidate``; on success the blobs lie in ``workdir``
    named as in an artifact directory, and the returned manifest (with the tuning table) is
    complete but unsigned.
    """
    before = set(sys.modules)
    try:
        return _compile(model_bytes, options, fingerprint=fingerprint, workdir=Path(workdir),
                        on_stage=on_stage, disabled_passes=disabled_passes, plugins=plugins,
                        plan=plan, samples=samples, calibration=calibration, reuse=reuse,
                        benchmark_lock=benchmark_lock)
    except BaseException:
        # A failed compile leaves no plugin module imported.
        for name in [n for n in sys.modules if n not in before and n.startswith("_kiln_plugin_")]:
            sys.modules.pop(name, None)
        raise


#: At most this many dataset samples verify a candidate.
MAX_SAMPLE_FEEDS = 64


def dataset_feeds(arrays: Mapping[str, np.ndarray], specs: Sequence[TensorSpec], *,
                  what: str, limit: int = MAX_SAMPLE_FEEDS) -> list[dict[str, np.ndarray]]:
    """Feeds from a dataset: sample ``i`` of every input together, each checked against the
    input signature (``InvalidOptions`` naming the mismatch)."""
    names = [spec.name for spec in specs]
    if set(arrays) != set(names):
        raise InvalidOptions(
            f"the {what} dataset holds {sorted(arrays)}; the model's inputs are {names}",
            dataset=sorted(arrays), inputs=names)
    counts = {name: int(np.shape(arrays[name])[0]) if np.ndim(arrays[name]) else 0
              for name in names}
    if len(set(counts.values())) != 1 or not min(counts.values()):
        raise InvalidOptions(f"every array of the {what} dataset must hold the same number (>0) "
                             f"of samples on its first axis; it holds {counts}")
    feeds = [{spec.name: np.array(arrays[spec.name][i], dtype=arrays[spec.name].dtype,
                                  order="C") for spec in specs}
             for i in range(min(limit, counts[names[0]]))]
    for spec in specs:
        sample = feeds[0][spec.name]
        fixed_ok = sample.ndim == len(spec.shape) and all(
            not isinstance(want, int) or want == got
            for want, got in zip(spec.shape, sample.shape, strict=True))
        if sample.dtype.name != spec.dtype or (list(spec.shape) != ["..."] and not fixed_ok):
            raise InvalidOptions(
                f"the {what} dataset's samples of input {spec.name!r} are "
                f"{sample.dtype.name}{list(sample.shape)}; the model expects "
                f"{spec.dtype}{list(spec.shape)} (a dataset array is [samples, *input shape])",
                input=spec.name)
    return feeds


def _given(plugins: Sequence[tuple[PluginRef, Path]] | None,
           ops: set[str]) -> Sequence[tuple[PluginRef, Path]]:
    """``plugins``, or ``CustomOpsFound`` when none were looked up and the model uses ``ops``."""
    if plugins is not None:
        return plugins
    if ops:
        raise CustomOpsFound(set(ops))
    return ()


def _compile(
    model_bytes: bytes,
    options: CompileOptions,
    *,
    fingerprint: HardwareFingerprint,
    workdir: Path,
    on_stage: StageCallback | None,
    disabled_passes: frozenset[str],
    plugins: Sequence[tuple[PluginRef, Path]] | None,
    plan: BuildPlan | None,
    samples: Mapping[str, np.ndarray] | None,
    calibration: Mapping[str, np.ndarray] | None,
    reuse: TuningTable | None,
    benchmark_lock: Path | None,
) -> CompileResult:
    stages = _Stages(on_stage)
    workdir.mkdir(parents=True, exist_ok=True)
    disabled = frozenset(disabled_passes)

    stages.enter(JobStage.LOADING)
    model_sha256 = sha256_hex(model_bytes)
    fmt = model_format(model_bytes)
    # Options no backend here accepts are refused before any work.
    backend = plan.backend if plan is not None else backends.backend_for(
        fingerprint, options, model_format=fmt)
    if fmt not in backend.model_formats:
        raise InvalidOptions(
            f"the model is a {fmt} model; the {backend.name} backend (fingerprint key "
            f"{backend.fingerprint_key(fingerprint)}) builds {sorted(backend.model_formats)} "
            f"models; target a key of a backend that takes {fmt}",
            model_format=fmt, backend=backend.name)
    if fmt == TORCH_EXPORT_FORMAT:
        return _compile_program(
            model_bytes, model_sha256, options, fingerprint=fingerprint, workdir=workdir,
            stages=stages, backend=backend, disabled=disabled, plugins=plugins, plan=plan,
            samples=samples, calibration=calibration, reuse=reuse,
            benchmark_lock=benchmark_lock)
    # A model archive (the .onnx and its external data) is unpacked, confined, into workdir.
    submitted = load_model(materialize_model(model_bytes, fresh_dir(workdir / "model")))
    model_ops = custom_ops(submitted)
    used = prepare_plugins(
        model_ops, _given(plugins, model_ops), backend,
        {o.domain: o.version for o in submitted.opset_import}, workdir)
    if model_ops:
        submitted = fill_attribute_defaults(submitted, used.registry)
    passes = default_pipeline(disabled, custom_ops=used.registry)
    if plan is None:  # in-process use; a job hands its plan in (computed once, by the runner)
        plan = plan_build(model_sha256, options, fingerprint, key=backend.fingerprint_key(
            fingerprint), disabled_passes=disabled, plugins=used.refs)
    # A plan whose toolchain (plugin digests included) is not what gets built is refused when
    # the first candidate's manifest is made (``manifest_for``).
    logger.info("compiling model %s with %s for %s (artifact %s)", model_sha256[:12],
                plan.backend.name, plan.fingerprint_key, plan.artifact_id)

    stages.enter(JobStage.CHECKING)
    prepared = passes.run(submitted, before_pass=lambda p: stages.enter(p.stage))
    stages.enter(JobStage.OPTIMIZING)
    inputs, outputs = signature(prepared)
    ranges = input_ranges(prepared)  # integer inputs stay inside the tables they index
    inputs = [spec.model_copy(update={"value_range": (ranges[spec.name].low,
                                                      ranges[spec.name].high)})
              if spec.name in ranges else spec for spec in inputs]
    if samples is not None:
        feeds = dataset_feeds(samples, inputs, what="samples")
        source = f"dataset:{options.samples}" if options.samples else "dataset"
    else:
        feeds = [random_inputs(inputs, options, seed=options.seed + i, ranges=ranges)
                 for i in range(options.verify_samples)]
        source = generated_inputs_source(describe_inputs(inputs, ranges))
    calibration_feeds: list[dict[str, np.ndarray]] = []
    calibration_note = ""
    if calibration is not None:
        calibration_feeds = dataset_feeds(calibration, inputs, what="calibration", limit=512)
    elif samples is not None:
        calibration_feeds = feeds
        calibration_note = "calibrated on the samples (no calibration dataset was given)"
    prepared_path = workdir / "prepared.onnx"
    save_model(prepared, prepared_path)  # over EXTERNAL_DATA_THRESHOLD: with external data

    stages.enter(JobStage.BUILDING)
    output_names = [spec.name for spec in outputs]
    reference = backends.reference_for("onnx").reference_runner(
        submitted, prepared, output_names, used.reference, used.ops)
    expected = [reference.run(feed) for feed in feeds]

    return _tune_and_finish(
        model_sha256, options, fingerprint=fingerprint, workdir=workdir, stages=stages,
        plan=plan, disabled=disabled, used=used, passes_applied=list(passes.applied),
        model_path=prepared_path, inputs=inputs, outputs=outputs, feeds=feeds,
        expected=expected, reference=reference, source=source,
        calibration_feeds=calibration_feeds, calibration_note=calibration_note, reuse=reuse,
        benchmark_lock=benchmark_lock, model_for=lambda _backend: prepared_path)


def _compile_program(
    model_bytes: bytes,
    model_sha256: str,
    options: CompileOptions,
    *,
    fingerprint: HardwareFingerprint,
    workdir: Path,
    stages: _Stages,
    backend: Backend,
    disabled: frozenset[str],
    plugins: Sequence[tuple[PluginRef, Path]] | None,
    plan: BuildPlan | None,
    samples: Mapping[str, np.ndarray] | None,
    calibration: Mapping[str, np.ndarray] | None,
    reuse: TuningTable | None,
    benchmark_lock: Path | None,
) -> CompileResult:
    """A ``torch.export`` program: checked and loaded here (never in the API), exported again
    with the profiles' dynamic axes where asked, verified against its eager module."""
    from compiler_worker.torch_program import EagerReference, load_program, prepare_program
    from schemas.plugins import torch_op_name
    from schemas.torch_export import inspect_export_archive

    submitted_path = fresh_dir(workdir / "model") / "model.pt2"
    submitted_path.write_bytes(model_bytes)
    stages.enter(JobStage.CHECKING)
    # The program's custom ops are registered as torch ops (kernels and fake implementations
    # from their plugins) before torch.export.load, which needs them to rebuild the graph.
    program_ops = set(inspect_export_archive(submitted_path).custom_ops)
    backend.check_program(program_ops)
    used = prepare_plugins(program_ops, _given(plugins, program_ops), backend, {}, workdir,
                           rename=torch_op_name)
    used.program_ops = set(program_ops)
    if used.adapter is not None:
        used.adapter.apply(None)
    loaded = load_program(submitted_path)
    if plan is None:  # in-process use; a job hands its plan in
        plan = plan_build(model_sha256, options, fingerprint,
                          key=backend.fingerprint_key(fingerprint), disabled_passes=disabled,
                          plugins=used.refs, model_format=TORCH_EXPORT_FORMAT)
    logger.info("compiling torch program %s with %s for %s (artifact %s)", model_sha256[:12],
                plan.backend.name, plan.fingerprint_key, plan.artifact_id)
    stages.enter(JobStage.OPTIMIZING)
    prepared = prepare_program(loaded, options, workdir / "prepared.pt2")
    inputs, outputs = prepared.inputs, prepared.outputs
    applied = ["dynamic_axes_from_profiles"] if prepared.dynamic_axes else []
    if samples is not None:
        feeds = dataset_feeds(samples, inputs, what="samples")
        source = f"dataset:{options.samples}" if options.samples else "dataset"
    else:
        # A dynamic axis without a profile is fed at the size the program was exported with.
        example = (loaded.program.example_inputs or ((), {}))[0]
        shapes = dict(options.shapes)
        for spec, arg in zip(inputs, example, strict=False):
            if spec.name not in shapes and any(not isinstance(d, int) for d in spec.shape):
                size = [int(d) for d in arg.shape]
                shapes[spec.name] = ShapeProfile(min=size, opt=size, max=size)
        feed_options = options.model_copy(update={"shapes": shapes})
        feeds = [random_inputs(inputs, feed_options, seed=options.seed + i)
                 for i in range(options.verify_samples)]
        source = generated_inputs_source(describe_inputs(inputs, {}))
    calibration_feeds = (dataset_feeds(calibration, inputs, what="calibration", limit=512)
                         if calibration is not None else [])
    stages.enter(JobStage.BUILDING)
    # A backend that builds another format converts the program here, once for all its
    # candidates (onnxruntime: the ONNX exporter); the reference stays the eager program.
    model_path = plan.backend.from_program(prepared.program, prepared.path, workdir,
                                           inputs=inputs, outputs=outputs)
    # Re-exported with new dynamic axes: the reference is the re-exported program's module
    # (the same eager code, traced again), since the submitted graph may fix those sizes.
    reference = EagerReference(prepared, "the program re-exported with the profiles' dynamic "
                                         "axes" if prepared.dynamic_axes else
                                         "the submitted program")
    expected = [reference.run(feed) for feed in feeds]
    return _tune_and_finish(
        model_sha256, options, fingerprint=fingerprint, workdir=workdir, stages=stages,
        plan=plan, disabled=disabled, used=used, passes_applied=applied,
        model_path=model_path, inputs=inputs, outputs=outputs, feeds=feeds,
        expected=expected, reference=reference, source=source,
        calibration_feeds=calibration_feeds, calibration_note="", reuse=reuse,
        benchmark_lock=benchmark_lock,
        model_for=lambda peer: peer.from_program(
            prepared.program, prepared.path, fresh_dir(workdir / f"convert-{peer.name}"),
            inputs=inputs, outputs=outputs))


def _tune_and_finish(
    model_sha256: str,
    options: CompileOptions,
    *,
    fingerprint: HardwareFingerprint,
    workdir: Path,
    stages: _Stages,
    plan: BuildPlan,
    disabled: frozenset[str],
    used: UsedPlugins,
    passes_applied: list[str],
    model_path: Path,
    inputs: list[TensorSpec],
    outputs: list[TensorSpec],
    feeds: list[dict[str, np.ndarray]],
    expected: list[dict[str, np.ndarray]],
    reference: _Reference,
    source: str,
    calibration_feeds: list[dict[str, np.ndarray]],
    calibration_note: str,
    reuse: TuningTable | None,
    benchmark_lock: Path | None,
    model_for: Callable[[Backend], Path],
) -> CompileResult:
    """Tune the prepared model (ONNX or torch program) and make the unsigned result: the
    plan's backend and its peers compete (``model_for``: the model file a peer builds)."""
    def manifest_for(built: BuiltEngine, candidate: Candidate,
                     backend: Backend) -> ArtifactManifest:
        planned = plan.toolchains.get(backend.name)
        if planned is None and backend.name == plan.backend.name:  # a plan made by hand
            planned = built.toolchain
        toolchain = compose_toolchain(built.toolchain, disabled, used.refs)
        if built.toolchain != planned or (not plan.peers and toolchain != plan.toolchain):
            raise CompileError(
                f"the {backend.name} backend built with toolchain {built.toolchain!r}, but the "
                f"plan (and the artifact id {plan.artifact_id}, toolchain {plan.toolchain!r}) "
                f"assumed {planned!r}; is the worker's toolchain installation consistent?"
            )
        return ArtifactManifest(
            artifact_id=plan.artifact_id,
            model_sha256=model_sha256,
            options_digest=options.digest(),
            options=options,
            backend=backend.name,
            fingerprint_key=plan.fingerprint_key,
            compatibility_key=backend.compatibility_key(fingerprint, dict(built.runtime_config)),
            toolchain=plan.toolchain,
            build_fingerprint=fingerprint,
            blobs=[],
            inputs=inputs,
            outputs=outputs,
            runtime_config=dict(built.runtime_config),
            plugins=list(used.refs),
            passes=passes_applied,
            inputs_source=source,
            precision=candidate.precision,
            # Derived from this candidate, not from the host: the winner's manifest carries
            # what the winning engine needs, and what it was tuned for.
            requirements=backend.executor.requirements(
                fingerprint, {**candidate.config, **built.runtime_config}, candidate.precision),
            tuning_context=backend.executor.tuning_context(
                fingerprint, {**candidate.config, **built.runtime_config},
                options.precision.value, threads_tuned=options.tune.value != "off"),
            # Placeholders until the tuner fills them in.
            verification=VerificationResult(
                passed=False, samples=0, max_abs_error=0.0, max_rel_error=0.0,
                atol=options.tolerance.atol, rtol=options.tolerance.rtol, reference="pending",
            ),
            benchmark=BenchmarkResult(iterations=0, warmup=0, p50_ms=0.0, p90_ms=0.0,
                                      mean_ms=0.0, min_ms=0.0),
            created_at=datetime.now(UTC),
        )

    if not runs_here(fingerprint):
        return cross_build(model_sha256, options, fingerprint=fingerprint, workdir=workdir,
                           plan=plan, used=used, model_path=model_path, feeds=feeds,
                           expected=expected, reference=reference.name, source=source,
                           manifest_for=manifest_for)
    outcome = tune(
        plan.backend, model_path, options, workdir / "tuning", fingerprint=fingerprint,
        toolchain=plan.toolchain, manifest_for=manifest_for, feeds=feeds, expected=expected,
        reference=reference.name, inputs=source, calibration=calibration_feeds,
        calibration_note=calibration_note, custom_ops=used.adapter, plugins=used.loaded,
        reuse=reuse, on_stage=stages.enter, peers=plan.peers, model_for=model_for,
        peer_custom_ops=peer_custom_ops(used, plan.peers, workdir),
        benchmark_lock=benchmark_lock, fingerprint_key=plan.fingerprint_key,
    )
    stages.enter(JobStage.BENCHMARKING)
    iterations = min(options.benchmark_iterations, 20)
    with host_lock(benchmark_lock, wait_s=max(1.0, options.tuning_budget_s)):
        reference_bench = benchmark(reference.run, feeds[0], iterations=iterations, warmup=1)
    manifest = outcome.manifest.model_copy(update={
        "benchmark": outcome.manifest.benchmark.model_copy(
            update={"reference_p50_ms": reference_bench.p50_ms}),
        "created_at": datetime.now(UTC),
    })
    manifest = add_golden(manifest, outcome.artifact_dir, feeds, expected)
    blob_paths = {ref.name: outcome.artifact_dir / blob_filename(ref) for ref in manifest.blobs}
    logger.info("artifact %s ready: %s, p50 %.3f ms (reference %.3f ms)", manifest.artifact_id,
                outcome.table.winner, manifest.benchmark.p50_ms, reference_bench.p50_ms)
    return CompileResult(manifest=manifest, blob_paths=blob_paths, plugin_paths=used.paths)



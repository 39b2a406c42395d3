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
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

import numpy as np

from artifact_store.digest import sha256_file
from artifact_store.signing import manifest_from_bytes
from compiler_worker import backends
from compiler_worker.backends.base import PIPELINE_VERSION, Backend, BuiltEngine, Candidate
from compiler_worker.benchmark import benchmark, host_lock
from compiler_worker.golden import add_golden
from compiler_worker.inputs import generated_inputs_source, input_ranges
from compiler_worker.modelio import load_model, materialize_model, save_model, signature
from compiler_worker.passes import default_pipeline
from compiler_worker.passes.custom_op_shapes import fill_attribute_defaults
from compiler_worker.tuner import PeerCustomOps, tune
from compiler_worker.verify import random_inputs, reference_custom_ops, reference_runner
from runtime_agent.executors import MANIFEST_FILENAME, CustomOpAdapter, blob_filename
from runtime_agent.fingerprint import detect_cpu
from runtime_agent.golden import GOLDEN_BLOB
from runtime_agent.plugins import (
    LoadedPlugin,
    NoImplementation,
    OpRegistry,
    load_bundle,
    split_op,
)
from runtime_agent.samples import describe_inputs
from schemas._canonical import canonical_json, sha256_hex
from schemas.errors import (
    CompileError,
    Conflict,
    IntegrityError,
    InvalidOptions,
    InvalidRequest,
    KilnError,
    ModelCheckFailed,
    PluginError,
    UnknownOperator,
    UnsupportedOperator,
)
from schemas.fingerprint import HardwareFingerprint
from schemas.jobs import JobStage
from schemas.manifest import (
    DEFERRED_TO_NODE,
    ArtifactManifest,
    BenchmarkResult,
    BlobRef,
    TensorSpec,
    VerificationResult,
)
from schemas.onnx_model import custom_ops
from schemas.options import CompileOptions, ShapeProfile, Tune
from schemas.plugins import PluginManifest, PluginRef
from schemas.torch_export import TORCH_EXPORT_FORMAT, model_format
from schemas.tuning import CandidateOutcome, CandidateResult, TuningTable

__all__ = [
    "PIPELINE_VERSION",
    "PLUGINS_DIRNAME",
    "BuildPlan",
    "CompileResult",
    "StageCallback",
    "artifact_id_for",
    "compile_model",
    "plan_build",
    "write_artifact_dir",
]

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
#: Where an artifact directory keeps the plugin bundles its engine needs:
#: ``plugins/<digest>.tar``.
PLUGINS_DIRNAME = "plugins"


@dataclass
class CompileResult:
    """A verified engine: its unsigned manifest and where its blobs are (inside ``workdir``)."""

    manifest: ArtifactManifest
    blob_paths: dict[str, Path]
    #: Bundle archive of every plugin in ``manifest.plugins``, by digest (the caller's files).
    plugin_paths: dict[str, Path] = field(default_factory=dict)


@dataclass(frozen=True)
class BuildPlan:
    """What a compile would produce, known before building: the cache key's parts."""

    backend: Backend
    fingerprint_key: str
    toolchain: str
    artifact_id: str
    #: Other backends of this hardware whose candidates compete in the same tuning (the
    #: winner's backend is the manifest's); their toolchains are part of ``toolchain``.
    peers: tuple[Backend, ...] = ()
    #: Each backend's own toolchain string, by name (``backend`` and every peer).
    toolchains: Mapping[str, str] = field(default_factory=dict)

    @property
    def backends(self) -> tuple[Backend, ...]:
        return (self.backend, *self.peers)


def artifact_id_for(
    model_sha256: str, options_digest: str, fingerprint_key: str, toolchain: str
) -> str:
    """The artifact id: the first 32 hex chars of the sha256 of the canonical cache key."""
    key = {
        "model_sha256": model_sha256,
        "options_digest": options_digest,
        "fingerprint_key": fingerprint_key,
        "toolchain": toolchain,
    }
    return sha256_hex(canonical_json(key))[:32]


def plugins_tag(plugins: Sequence[PluginRef]) -> str:
    """``plugins-<16 hex>``: a digest of the plugin bundles' digests (order-free)."""
    digests = sorted({ref.digest for ref in plugins})
    return f"plugins-{sha256_hex(canonical_json({'plugins': digests}))[:16]}"


def _toolchain(backend_toolchain: str, disabled_passes: frozenset[str],
               plugins: Sequence[PluginRef] = ()) -> str:
    # Disabling a pass changes the engine, so it is part of the toolchain (and the cache key);
    # so are the plugin bundles the engine runs (a new plugin version, a new artifact).
    toolchain = backend_toolchain
    if disabled_passes:
        toolchain += f"+without-{','.join(sorted(disabled_passes))}"
    if plugins:
        toolchain += f"+{plugins_tag(plugins)}"
    return toolchain


def peers_for(backend: Backend, fingerprint: HardwareFingerprint, options: CompileOptions,
              model_format: str | None = None) -> tuple[Backend, ...]:
    """The backends whose candidates compete with ``backend``'s in one tuning: registered,
    on the same device, supporting ``fingerprint``, taking ``model_format`` (as it is or by
    converting it), accepting ``options``, and named in ``options.backends`` when the user
    named any. None when ``options.tune`` is off (only the default is built). Sorted by name,
    so a worker and its sandboxed child plan the same artifact."""
    if options.tune is not Tune.AUTO:
        return ()
    found = []
    for other in backends.available():
        if other.name == backend.name or other.device != backend.device:
            continue
        if options.backends and other.name not in options.backends:
            continue
        if not options.backends and not other.races_unnamed:
            continue
        if model_format is not None and model_format not in other.model_formats:
            continue
        if not other.supports(fingerprint):
            continue
        try:
            other.check_options(options)
            other.toolchain()
        except KilnError as exc:
            logger.debug("backend %s does not compete here: %s", other.name, exc.message)
            continue
        found.append(other)
    return tuple(sorted(found, key=lambda b: b.name))


def plan_build(
    model_sha256: str,
    options: CompileOptions,
    fingerprint: HardwareFingerprint,
    *,
    key: str | None = None,
    disabled_passes: frozenset[str] = frozenset(),
    plugins: Sequence[PluginRef] = (),
    model_format: str | None = None,
) -> BuildPlan:
    """Backend, fingerprint key, toolchain and artifact id for a compile, without building.

    ``key``: the fingerprint key the job was queued for (the backend is the one whose key it
    is here); without it, the highest-priority backend that supports ``fingerprint``. Its
    ``peers`` (``peers_for``) tune beside it; their toolchains join the plan's.
    ``plugins``: the plugin bundles providing the model's custom ops (their digests are part of
    the toolchain). A caller looks the artifact id up in its store first: same key, same
    artifact. Computed once per job and handed to ``compile_model``. ``model_format``
    (``onnx``, ``torch-export``): only a backend that takes it.
    """
    backend = backends.backend_for(fingerprint, options, key, model_format=model_format)
    # A job queued under this host's tuning-context key publishes under that key.
    own_key = key if key == backend.context_key(fingerprint) else backend.fingerprint_key(
        fingerprint)
    peers = peers_for(backend, fingerprint, options, model_format or "onnx")
    toolchains = {b.name: b.toolchain() for b in (backend, *peers)}
    built_by = toolchains[backend.name]
    if peers:  # an engine of any of them may win: each one's version is part of the key
        built_by += "+with-" + ",".join(toolchains[p.name] for p in peers)
    toolchain = _toolchain(built_by, frozenset(disabled_passes), plugins)
    return BuildPlan(
        backend=backend,
        fingerprint_key=own_key,
        toolchain=toolchain,
        artifact_id=artifact_id_for(model_sha256, options.digest(), own_key, toolchain),
        peers=peers,
        toolchains=toolchains,
    )


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


def _fresh_dir(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


#: Where the verification reference runs a model's custom ops.
REFERENCE_TARGET = ("onnxruntime", "cpu")


@dataclass
class _Plugins:
    """The plugins a compile uses: loaded, their ops, and what the sessions register."""

    loaded: list[LoadedPlugin] = field(default_factory=list)
    registry: OpRegistry = field(default_factory=OpRegistry)
    refs: list[PluginRef] = field(default_factory=list)
    paths: dict[str, Path] = field(default_factory=dict)
    #: What the backend's build registers for the model's custom ops.
    adapter: CustomOpAdapter | None = None
    ops: set[str] = field(default_factory=set)
    #: The same plugins loaded for the reference's onnxruntime session.
    reference: list[LoadedPlugin] = field(default_factory=list)
    #: A torch program's custom ops as torch names them (empty for an ONNX model).
    program_ops: set[str] = field(default_factory=set)


def _prepare_plugins(model_ops: set[str], plugins: Sequence[tuple[PluginRef, Path]],
                     backend: Backend, model_opsets: dict[str, int], workdir: Path, *,
                     rename: Callable[[str], str] | None = None) -> _Plugins:
    """Unpack and check every bundle, refuse ops nobody declares (before any plugin code is
    imported), then load the plugins that provide the model's ops for the target.
    ``rename``: how the model names a declared op (``torch_op_name`` for a torch program),
    when not ``domain::OpType``."""
    from artifact_store.bundles import extract_bundle

    if not model_ops:
        if plugins:
            logger.info("the model has no custom ops; plugins %s are not needed",
                        [f"{ref.name} {ref.version}" for ref, _ in plugins])
        return _Plugins()
    device = backend.device
    root = workdir / PLUGINS_DIRNAME
    manifests: list[tuple[PluginRef, Path, PluginManifest]] = []
    for ref, archive in {ref.digest: (ref, Path(path)) for ref, path in plugins}.values():
        if not archive.is_file():
            raise InvalidRequest(f"plugin {ref.name} {ref.version}: bundle {archive} does not "
                                 f"exist", plugin=ref.name)
        manifest = extract_bundle(archive, root / ref.digest, digest=ref.digest)
        if (manifest.name, manifest.version) != (ref.name, ref.version):
            raise IntegrityError(
                f"bundle {ref.digest[:12]} holds plugin {manifest.name} {manifest.version}, not "
                f"{ref.name} {ref.version}", digest=ref.digest)
        manifests.append((ref, archive, manifest))
    if rename is not None:
        names = {rename(spec.qualified_name): spec.qualified_name
                 for _, _, manifest in manifests for spec in manifest.ops}
        model_ops = {names.get(op, op) for op in model_ops}
    provider: dict[str, tuple[PluginRef, Path, PluginManifest]] = {}
    for entry in manifests:
        for spec in entry[2].ops:
            other = provider.setdefault(spec.qualified_name, entry)
            if other is not entry and spec.qualified_name in model_ops:
                raise Conflict(
                    f"op {spec.qualified_name} is declared by plugin {other[0].name} "
                    f"{other[0].version} and by plugin {entry[0].name} {entry[0].version}; "
                    f"compile with one of them", op=spec.qualified_name)
    missing = sorted(model_ops - set(provider))
    if missing:
        domains = sorted({split_op(op)[0] for op in missing})
        raise UnknownOperator(
            f"the model uses {missing} (domain(s) {domains}), which no plugin given to the "
            f"compile declares; ops declared: {sorted(provider) or 'none'} (plugins "
            f"{[f'{r.name} {r.version}' for r, _, _ in manifests] or 'none'})",
            missing=missing, registered=sorted(provider),
        )
    if not backend.accepts_plugins:
        raise NoImplementation(
            f"the model uses custom ops {sorted(model_ops)}; the {backend.name} backend builds "
            f"no custom ops yet", backend=backend.name, ops=sorted(model_ops))
    for op in sorted(model_ops):
        spec = next(s for s in provider[op][2].ops if s.qualified_name == op)
        domain = split_op(op)[0]
        imported = model_opsets.get(domain)
        if imported is not None and imported < spec.since_version:
            raise ModelCheckFailed(
                f"the model imports domain {domain!r} at version {imported}; op {op} exists from "
                f"version {spec.since_version} (plugin {provider[op][0].name})", op=op)
    used = {id(entry): entry for op, entry in provider.items() if op in model_ops}
    result = _Plugins()
    abi = backend.plugin_abi()
    target = (backend.executor.plugin_backend or backend.name, device)
    for ref, archive, manifest in sorted(used.values(), key=lambda e: e[0].name):
        ops = sorted(op for op in model_ops if provider[op][2] is manifest)
        result.loaded.append(load_bundle(archive, ref, root, target=target,
                                         abi=abi, ops=ops))
        result.refs.append(ref)
        result.paths[ref.digest] = archive
    result.registry = OpRegistry.union(p.registry for p in result.loaded)
    result.adapter = backend.custom_op_adapter(result.loaded, model_ops)
    result.reference = result.loaded
    if target != REFERENCE_TARGET:
        # The reference runs on onnxruntime's CPU provider whatever the engine's backend
        # (an OpenVINO engine runs the bundle's extension; the reference its onnxruntime
        # kernels): load those too, by the same checks.
        result.reference = [
            load_bundle(result.paths[p.digest], p.ref, root, target=REFERENCE_TARGET,
                        abi=None, ops=sorted(set(p.ops()) & model_ops))
            for p in result.loaded]
    result.ops = set(model_ops)
    logger.info("custom ops %s from plugins %s", sorted(model_ops),
                [f"{r.name} {r.version}" for r in result.refs])
    return result


def _peer_custom_ops(used: _Plugins, peers: Sequence[Backend],
                     workdir: Path) -> dict[str, PeerCustomOps]:
    """Each peer's own adapter for the model's custom ops, from the same bundles loaded for
    the peer's target and ABI (an OpenVINO peer: their extensions; onnxruntime: their
    kernels), so that its engines record and load their own implementations; or why the peer
    cannot build them (no implementation for its target, another ABI, a torch program's ops
    its front end cannot take): its candidates are then skipped with that reason."""
    prepared: dict[str, PeerCustomOps] = {}
    if not used.ops:
        return prepared
    for peer in peers:
        target = (peer.executor.plugin_backend or peer.name, peer.device)
        try:
            if not peer.accepts_plugins:
                raise NoImplementation(f"the {peer.name} backend builds no custom ops yet",
                                       backend=peer.name, ops=sorted(used.ops))
            if used.program_ops:
                peer.check_program(used.program_ops)
            loaded = [load_bundle(used.paths[p.digest], p.ref, workdir / PLUGINS_DIRNAME,
                                  target=target, abi=peer.plugin_abi(),
                                  ops=sorted(set(p.ops()) & used.ops))
                      for p in used.loaded]
            adapter = peer.custom_op_adapter(loaded, used.ops)
        except (PluginError, UnsupportedOperator) as exc:
            why = (f"the model's custom ops {sorted(used.ops)} cannot be built by the "
                   f"{peer.name} backend: {exc.message}")
            logger.info("%s candidates are skipped: %s", peer.name, why)
            prepared[peer.name] = PeerCustomOps(skip=why)
            continue
        prepared[peer.name] = PeerCustomOps(adapter, loaded)
        logger.info("custom ops %s for %s from plugins %s", sorted(used.ops), peer.name,
                    [p.label for p in loaded])
    return prepared


def compile_model(
    model_bytes: bytes,
    options: CompileOptions,
    *,
    fingerprint: HardwareFingerprint,
    workdir: Path,
    on_stage: StageCallback | None = None,
    disabled_passes: frozenset[str] = frozenset(),
    plugins: Sequence[tuple[PluginRef, Path]] = (),
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
    recorded in the manifest; others are ignored). ``samples`` / ``calibration``: the arrays
    of the datasets ``options.samples`` / ``options.calibration`` name (sample ``i`` of input
    ``x`` is ``samples["x"][i]``); without samples, inputs are generated to fit the graph.
    ``reuse``: an earlier tuning record for the same cache key (only its winner is built).
    ``benchmark_lock``: the host-wide lock file every timing waits for (default: the host's,
    ``compiler_worker.benchmark.default_lock_path``).

    Raises ``InvalidModel``, ``ModelCheckFailed``, ``UnsupportedOpset``, ``InvalidOptions``,
    ``BackendUnavailable``, ``UnknownOperator``, ``PluginError`` (``NoImplementation``,
    ``AbiMismatch``, ``ShapeFunctionError``), ``IntegrityError`` (a bundle that does not match
    its ref), ``CompileError``, ``VerificationFailed``, ``AccuracyGateFailed`` or
    ``NoViableCandidate``; on success the blobs lie in ``workdir`` named as in an artifact
    directory, and the returned manifest (with the tuning table) is complete but unsigned.
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


def _compile(
    model_bytes: bytes,
    options: CompileOptions,
    *,
    fingerprint: HardwareFingerprint,
    workdir: Path,
    on_stage: StageCallback | None,
    disabled_passes: frozenset[str],
    plugins: Sequence[tuple[PluginRef, Path]],
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
    submitted = load_model(materialize_model(model_bytes, _fresh_dir(workdir / "model")))
    model_ops = custom_ops(submitted)
    used = _prepare_plugins(
        model_ops, plugins, backend,
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
    reference = reference_runner(submitted, prepared, output_names,
                                 custom_ops=reference_custom_ops(used.reference, used.ops))
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
    plugins: Sequence[tuple[PluginRef, Path]],
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

    submitted_path = _fresh_dir(workdir / "model") / "model.pt2"
    submitted_path.write_bytes(model_bytes)
    stages.enter(JobStage.CHECKING)
    # The program's custom ops are registered as torch ops (kernels and fake implementations
    # from their plugins) before torch.export.load, which needs them to rebuild the graph.
    program_ops = set(inspect_export_archive(submitted_path).custom_ops)
    backend.check_program(program_ops)
    used = _prepare_plugins(program_ops, plugins, backend, {}, workdir, rename=torch_op_name)
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
            prepared.program, prepared.path, _fresh_dir(workdir / f"convert-{peer.name}"),
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
    used: _Plugins,
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
        toolchain = _toolchain(built.toolchain, disabled, used.refs)
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
        return _cross_build(model_sha256, options, fingerprint=fingerprint, workdir=workdir,
                            plan=plan, used=used, model_path=model_path, feeds=feeds,
                            expected=expected, reference=reference, source=source,
                            manifest_for=manifest_for)
    outcome = tune(
        plan.backend, model_path, options, workdir / "tuning", fingerprint=fingerprint,
        toolchain=plan.toolchain, manifest_for=manifest_for, feeds=feeds, expected=expected,
        reference=reference.name, inputs=source, calibration=calibration_feeds,
        calibration_note=calibration_note, custom_ops=used.adapter, plugins=used.loaded,
        reuse=reuse, on_stage=stages.enter, peers=plan.peers, model_for=model_for,
        peer_custom_ops=_peer_custom_ops(used, plan.peers, workdir),
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


def runs_here(fingerprint: HardwareFingerprint) -> bool:
    """Whether an engine for ``fingerprint`` can run on this machine: the same architecture.
    One for another (a declared aarch64 node's, cross-compiled) is built, never loaded here."""
    return fingerprint.cpu.arch == detect_cpu().arch


def _cross_build(
    model_sha256: str,
    options: CompileOptions,
    *,
    fingerprint: HardwareFingerprint,
    workdir: Path,
    plan: BuildPlan,
    used: _Plugins,
    model_path: Path,
    feeds: list[dict[str, np.ndarray]],
    expected: list[dict[str, np.ndarray]],
    reference: _Reference,
    source: str,
    manifest_for: Callable[[BuiltEngine, Candidate, Backend], ArtifactManifest],
) -> CompileResult:
    """An engine for an architecture this worker cannot run: the plan's backend builds its
    default candidate for ``fingerprint``, with no verification and no timing here (emulation
    is never timed, and a winner cannot be picked without timings). The manifest says both
    were deferred to the node, and carries the reference's golden outputs: the agent's golden
    check on activation is then mandatory, and decides."""
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
    built = backend.build(model_path, options, _fresh_dir(workdir / "cross" / "build"),
                          fingerprint=fingerprint, candidate=candidate,
                          custom_ops=used.adapter)
    build_s = time.perf_counter() - started
    artifact_dir = _fresh_dir(workdir / "cross" / "artifact")
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
            atol=options.tolerance.atol, rtol=options.tolerance.rtol, reference=reference.name,
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


def _copy_checked(source: Path, destination: Path, sha256: str, size: int | None = None, *,
                  what: str) -> None:
    """Copy ``source``; ``IntegrityError`` unless the copy has this sha256 (and size)."""
    shutil.copyfile(source, destination)
    got_size, digest = destination.stat().st_size, sha256_file(destination)[0]
    if digest != sha256 or (size is not None and got_size != size):
        expected = f"{size} bytes and sha256 {sha256}" if size is not None else f"sha256 {sha256}"
        raise IntegrityError(f"{what} has {got_size} bytes and sha256 {digest}; the manifest "
                             f"lists {expected}")


def write_artifact_dir(
    result: CompileResult, out_dir: Path, manifest: ArtifactManifest | bytes | None = None
) -> Path:
    """Write ``manifest.json`` and the blobs (named by ``blob_filename``) to ``out_dir``.

    ``manifest`` defaults to ``result.manifest`` (unsigned); pass the signed envelope
    (``Signer.sign_manifest``) to write those bytes as they are. Every blob
    is checked against the manifest's size and sha256 as it is copied; so is every plugin
    bundle the manifest names, copied to ``plugins/<digest>.tar`` (where ``kiln.runtime.load``
    finds them). The directory appears atomically: it is built in a temporary sibling, then
    renamed. An existing ``out_dir`` is refused (``Conflict``).
    """
    manifest = manifest if manifest is not None else result.manifest
    if isinstance(manifest, bytes):
        stored, manifest = manifest, manifest_from_bytes(manifest)
    else:
        stored = manifest.model_dump_json(indent=2).encode() + b"\n"
    if manifest.artifact_id != result.manifest.artifact_id:
        raise InvalidRequest(
            f"the manifest is for artifact {manifest.artifact_id}, the result for "
            f"{result.manifest.artifact_id}"
        )
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise Conflict(f"{out_dir} already exists; choose a new directory for the artifact")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    try:
        for ref in manifest.blobs:
            source = result.blob_paths.get(ref.name)
            if source is None:
                raise IntegrityError(
                    f"the manifest lists blob {ref.name!r}; the result has "
                    f"{sorted(result.blob_paths)}"
                )
            _copy_checked(source, staging / blob_filename(ref), ref.sha256, ref.size,
                          what=f"blob {ref.name!r} ({source})")
        for plugin in manifest.plugins:
            source = result.plugin_paths.get(plugin.digest)
            if source is None:
                raise IntegrityError(
                    f"the manifest names plugin {plugin.name} {plugin.version} "
                    f"({plugin.digest}); the result has no bundle for it"
                )
            (staging / PLUGINS_DIRNAME).mkdir(exist_ok=True)
            _copy_checked(source, staging / PLUGINS_DIRNAME / f"{plugin.digest}.tar",
                          plugin.digest, what=f"plugin bundle {source} "
                                              f"({plugin.name} {plugin.version})")
        (staging / MANIFEST_FILENAME).write_bytes(stored)
        staging.chmod(0o755)
        os.rename(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("wrote artifact %s to %s", manifest.artifact_id, out_dir)
    return out_dir

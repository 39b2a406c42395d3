"""ONNX Runtime (CPU) backend: saves the model onnxruntime optimized, at the configuration the
tuner picked.

Levels: 0 ``ORT_DISABLE_ALL``, 1 ``ORT_ENABLE_BASIC``, 2 ``ORT_ENABLE_EXTENDED``,
3 ``ORT_ENABLE_ALL``.

Candidates (``candidates``), the default first:

- fp32 at levels 3, 1 and 2 (sequential execution, onnxruntime's default intra-op threads),
  level 3 with parallel execution, and level 3 on one intra-op thread (tiny models lose more
  to thread hand-offs than they gain). Threads are a policy (``thread_policy``, resolved by
  the executor against the node's own cores), never the tuning worker's count;
- where the precision policy allows it: ``int8-dynamic`` (``quantize_dynamic``, weights int8
  per tensor, activations quantized at run time) and ``int8-static-qdq`` (``quantize_static``
  in QDQ format with per-channel weights and MinMax ranges, calibrated on the calibration
  dataset, or on the samples when no calibration set is given); on CPUs without VNNI,
  weights use the reduced 7-bit range that keeps AVX2's ``vpmaddubsw`` from saturating.
  When static int8 misses the accuracy gate, the tuner builds, one after another until one
  meets it (``Candidate.fallback_of``): Percentile and Entropy calibration, the edge nodes
  (first and last int8 nodes, those next to a softmax or a normalization) kept in fp32, and
  the most sensitive nodes kept in fp32 (each int8 node's output against the fp32 model's on
  a few calibration feeds, by signal-to-quantization-noise ratio: the nodes that lose the
  most). The quantization itself lives in ``compiler_worker.backends.onnxruntime.int8``;
- ``bf16-fastmath`` on aarch64 CPUs with bf16 instructions (MLAS's bf16 GEMM). onnxruntime's
  CPU provider has no bf16 or fp16 GEMM on x86-64, so those candidates are recorded as
  skipped there rather than built as something else.

``portability: portable`` keeps levels 0–2 only. ``optimization_level``, when given, pins the
level.

Portability. Basic and extended optimizations rewrite the graph with standard ONNX ops and
onnxruntime's own contrib ops (``FusedConv``, ``LayerNormalization``, ``QLinearConv``...): the
saved model runs on any CPU of the same architecture under the same onnxruntime
``major.minor``. Level 3 adds layout optimizations (``com.microsoft.nchwc`` blocked
convolutions whose block size follows the vector width) — onnxruntime warns that such a model
"should only be used in the same environment the model was optimized in". Hence the
fingerprint key carries the ISA class. These rules are defined once, in the executor twin
``runtime_agent.executors.onnxruntime``, so an agent computes the same keys.

Loading. The saved engine already is the optimized graph, so ``runtime_config`` tells the
executor to load it with ``ORT_DISABLE_ALL`` (``graph_optimization_level: 0``): re-optimizing at
load time would cost start-up time and run a graph other than the one Kiln verified. The level
the engine was built at is kept as ``optimization_level``. Engines over 1.5 GB keep their
initializers in a second blob, ``engine.onnx.data`` (protobuf's 2 GB limit).

PyTorch programs. A ``torch.export`` archive (``.pt2``) is built too: ``from_program``, in the
build step where the pipeline loaded the program, exports it with
``torch.onnx.export(program, dynamo=True)`` (the exporter translates the program's ATen graph;
the program's inputs and outputs keep their names, its dynamic dimensions stay symbolic), and
the candidates build from that ONNX model as from a submitted one. The reference stays the
program's eager module, as for every backend building a program: the engine is verified
against PyTorch, not against the exported ONNX. An ATen op the exporter cannot translate
fails the build with ``UnsupportedOperator`` naming it (``details["op"]``, e.g.
``aten::kthvalue``); so does a program with custom ops (their plugins' kernels are torch
kernels, which onnxruntime cannot run). Workers advertise ``torch-export`` for this backend's
key only where torch is installed (``model_formats``).

Custom ops. ``build(..., custom_ops=SessionCustomOps)`` registers the plugins' Python kernels
(through onnxruntime-extensions) and native libraries with the optimizing session, exactly as
the executor will, and records them in ``runtime_config["custom_ops"]``. onnxruntime keeps
custom nodes as they are: its fusions match only the operators they know, so none crosses a
custom node, while constant folding and fusions around it still apply. Models with custom ops
are not quantized (the quantizer cannot see through an op it does not know).
"""

from __future__ import annotations

import importlib.util
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from compiler_worker.backends.base import (
    Backend,
    BuiltEngine,
    Candidate,
    major_minor,
    toolchain_string,
)
from compiler_worker.backends.onnxruntime.int8 import quantize as quantize_int8
from compiler_worker.backends.onnxruntime.reference import (
    REFERENCE_TARGET,
    OnnxRuntimeReference,
    reference_custom_ops,
    reference_runner,
)
from runtime_agent.executors.base import CustomOpAdapter
from runtime_agent.executors.onnxruntime.executor import (
    ENGINE_MEDIA_TYPE,
    OnnxRuntimeExecutor,
)
from schemas.errors import (
    BackendUnavailable,
    CompileError,
    FingerprintMismatch,
    InvalidOptions,
    UnsupportedOperator,
)
from schemas.fingerprint import HardwareFingerprint
from schemas.manifest import TensorSpec
from schemas.options import CompileOptions, Portability, Precision
from schemas.technologies.onnxruntime import HARDWARE_SPECIFIC_LEVEL as HARDWARE_SPECIFIC
from schemas.tuning import ThreadPolicy

if TYPE_CHECKING:
    import numpy as np

    from runtime_agent.plugins import LoadedPlugin

logger = logging.getLogger(__name__)

PROVIDERS = ["CPUExecutionProvider"]
LEVEL_NAMES = {
    0: "ORT_DISABLE_ALL",
    1: "ORT_ENABLE_BASIC",
    2: "ORT_ENABLE_EXTENDED",
    3: "ORT_ENABLE_ALL",
}
#: Models whose file and external data exceed this are saved with external data too.
EXTERNAL_DATA_THRESHOLD = 1_500_000_000
ENGINE_DATA_BLOB = "engine.onnx.data"
_INT8 = (Precision.AUTO, Precision.INT8)


def _model_bytes_on_disk(model_path: Path) -> int:
    """The model file plus every external-data file beside it that it names (the graph is
    read without its data)."""
    import onnx

    from schemas.onnx_model import external_refs

    model = onnx.load(str(model_path), load_external_data=False)
    locations = {ref.path for ref in external_refs(model)}
    return model_path.stat().st_size + sum(
        (model_path.parent / location).stat().st_size for location in locations
        if (model_path.parent / location).is_file())


#: How the ONNX exporter names the op it has no translation for.
_EXPORTER_OP = (
    re.compile(r"No ONNX function found for <OpOverload\(op='([A-Za-z0-9_.]+)'"),
    re.compile(r"target=torch\.ops\.([A-Za-z0-9_]+\.[A-Za-z0-9_]+)"),
    re.compile(r"Unsupported FX nodes: \{'call_function': \['([A-Za-z0-9_]+\.[A-Za-z0-9_]+)"),
)


def unexported_op(exc: BaseException) -> str | None:
    """``aten::kthvalue`` for an exporter failure about ``aten.kthvalue`` (the cause chain
    is searched); ``None`` when the failure names no op."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for pattern in _EXPORTER_OP:
            match = pattern.search(str(current))
            if match:
                namespace, _, name = match.group(1).partition(".")
                return f"{namespace}::{name.split('.')[0]}"
        current = current.__cause__ or current.__context__
    return None


class OnnxRuntimeBackend(Backend):
    """onnxruntime's CPU execution provider; keyed by ISA class and onnxruntime major.minor."""

    name = "onnxruntime"
    executor = OnnxRuntimeExecutor
    priority = 10
    device = "cpu"
    converts = frozenset({"torch-export"})
    reference_formats = frozenset({"onnx"})
    reference_target = REFERENCE_TARGET

    def reference_runner(self, submitted: Any, prepared: Any, output_names: list[str],
                         plugins: Sequence[LoadedPlugin] = (),
                         ops: Iterable[str] = ()) -> OnnxRuntimeReference:
        return reference_runner(submitted, prepared, output_names,
                                custom_ops=reference_custom_ops(plugins, ops))

    @property
    def model_formats(self) -> frozenset[str]:  # type: ignore[override]
        """ONNX models, and ``torch.export`` programs where torch (with its ONNX exporter) is
        installed: ``from_program`` exports them."""
        if importlib.util.find_spec("torch") and importlib.util.find_spec("onnxscript"):
            return frozenset({"onnx", "torch-export"})
        return frozenset({"onnx"})

    def check_program(self, custom_ops: set[str]) -> None:
        if custom_ops:
            op = sorted(custom_ops)[0]
            raise UnsupportedOperator(
                f"the {self.name} backend builds torch programs through the ONNX exporter, "
                f"which cannot translate custom ops {sorted(custom_ops)} (their plugins' "
                f"kernels are torch kernels); build this program with a backend that runs "
                f"torch programs", op=op, ops=sorted(custom_ops), backend=self.name)

    def from_program(self, program: Any, program_path: Path, workdir: Path, *,
                     inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> Path:
        """Export the program with ``torch.onnx.export(..., dynamo=True)`` to
        ``workdir/program.onnx``."""
        import torch

        destination = workdir / "program.onnx"
        try:
            exported = torch.onnx.export(
                program, dynamo=True, input_names=[spec.name for spec in inputs],
                output_names=[spec.name for spec in outputs], verbose=False)
        except Exception as exc:  # the exporter raises its own untyped errors
            op = unexported_op(exc)
            if op is not None:
                raise UnsupportedOperator(
                    f"torch {torch.__version__}'s ONNX exporter cannot translate op {op}, so "
                    f"the {self.name} backend cannot build this program (other backends "
                    f"still may): {type(exc).__name__}: {str(exc)[:1500]}",
                    op=op, backend=self.name) from exc
            raise CompileError(
                f"torch {torch.__version__}'s ONNX exporter could not export the program for "
                f"the {self.name} backend: {type(exc).__name__}: {exc}"[:2000],
                backend=self.name) from exc
        if exported is None:
            raise CompileError(f"torch {torch.__version__}'s ONNX exporter returned nothing")
        exported.save(str(destination))
        logger.info("exported the torch program to ONNX (%s)", destination.name)
        return destination

    def toolchain(self) -> str:
        version = self.executor.probe_version()
        if version is None:
            raise BackendUnavailable("onnxruntime is not installed on this worker")
        return toolchain_string(self.name, version)

    def check_options(self, options: CompileOptions) -> None:
        if options.precision in (Precision.FP16,):
            raise BackendUnavailable(
                f"the {self.name} CPU backend builds no fp16 engines (its CPU provider has "
                f"no fp16 GEMM); use precision fp32, auto, int8 or bf16 (aarch64 with bf16), or "
                f"a GPU backend",
                precision=options.precision.value,
                supported=[p.value for p in Precision if p is not Precision.FP16],
            )

    def candidates(self, fingerprint: HardwareFingerprint,
                   options: CompileOptions) -> list[Candidate]:
        portable = options.portability is Portability.PORTABLE
        if options.optimization_level is not None:
            levels = [options.optimization_level]
        else:
            levels = [2, 1] if portable else [3, 1, 2]
        levels = [level for level in levels if not (portable and level >= HARDWARE_SPECIFIC)]
        if not levels:
            raise InvalidOptions(
                f"optimization_level {options.optimization_level} saves a hardware-specific "
                f"model, which portability: portable excludes; use a level up to "
                f"{HARDWARE_SPECIFIC - 1}, or portability: exact")
        top = levels[0]
        found: list[Candidate] = []

        def add(name: str, level: int, precision: str = "fp32", skip: str = "",
                needs_calibration: bool = False, fallback_of: str = "",
                **config: object) -> None:
            found.append(Candidate(
                name=f"{self.name}/{name}", precision=precision, skip=skip,
                portable=level < HARDWARE_SPECIFIC, needs_calibration=needs_calibration,
                fallback_of=fallback_of, config={"optimization_level": level, **config}))

        if options.precision in (Precision.FP32, Precision.AUTO):
            for level in levels:
                add(f"l{level}", level)
            add(f"l{top}-parallel", top, execution_mode="parallel")
            # A policy, resolved by the executor on the node that runs it: never the worker's
            # own core count frozen into the engine.
            add(f"l{top}-1thread", top, thread_policy=ThreadPolicy.ONE.value)
        features = set(fingerprint.cpu.features)
        if options.precision in _INT8:
            vnni = bool(features & {"avx512_vnni", "avx_vnni", "amx_int8", "i8mm", "asimddp",
                                    "dotprod"})
            add(f"int8-dynamic-l{top}", top, "int8-dynamic", quantize="dynamic")
            static = f"int8-static-qdq-l{top}"
            add(static, top, "int8-static-qdq", quantize="static-qdq",
                needs_calibration=True, reduce_range=not vnni)
            # Built only when the static candidate misses the accuracy gate, each in turn
            # until one meets it: other calibrations of the activations' ranges, then the
            # nodes that hurt accuracy most kept in fp32.
            for suffix, extra in (
                    ("percentile", {"calibrate": "percentile"}),
                    ("entropy", {"calibrate": "entropy"}),
                    ("keep-edges-fp32", {"exclude": "edges"}),
                    ("keep-sensitive-fp32", {"exclude": "sensitive"})):
                add(f"int8-static-qdq-{suffix}-l{top}", top, "int8-static-qdq",
                    quantize="static-qdq", needs_calibration=True, reduce_range=not vnni,
                    fallback_of=f"{self.name}/{static}", **extra)
        if options.precision in (Precision.AUTO, Precision.BF16):
            arm_bf16 = fingerprint.cpu.arch == "aarch64" and "bf16" in features
            add(f"bf16-fastmath-l{top}", top, "bf16-fastmath", bf16_fastmath=True,
                skip="" if arm_bf16 else (
                    "onnxruntime's CPU provider has bf16 GEMM only on aarch64 CPUs with bf16 "
                    f"instructions; this is {fingerprint.cpu.arch} with "
                    f"{'bf16' if 'bf16' in features or 'avx512_bf16' in features else 'no bf16'}"
                ))
        return found

    def _build(
        self,
        model_path: Path,
        options: CompileOptions,
        workdir: Path,
        *,
        fingerprint: HardwareFingerprint | None,
        candidate: Candidate,
        custom_ops: CustomOpAdapter | None,
        calibration: list[Mapping[str, np.ndarray]],
    ) -> BuiltEngine:
        import onnxruntime as ort

        if fingerprint is not None:
            declared = major_minor(fingerprint.runtimes.get(self.executor.runtime))
            if declared != major_minor(ort.__version__):
                raise FingerprintMismatch(
                    f"the build fingerprint declares onnxruntime "
                    f"{fingerprint.runtimes.get(self.executor.runtime)}, but this worker runs "
                    f"onnxruntime {ort.__version__}; an engine built here would carry the wrong "
                    f"key"
                )
        if "CPUExecutionProvider" not in ort.get_available_providers():
            raise BackendUnavailable(
                f"Requested providers were: {PROVIDERS}, but available providers are: "
                f"{ort.get_available_providers()}"
            )
        config = dict(candidate.config)
        level = int(config["optimization_level"])  # type: ignore[call-overload]
        # Read once: an int8 model is smaller than its source, so the source's answer holds.
        external = _model_bytes_on_disk(model_path) > EXTERNAL_DATA_THRESHOLD
        quantize = config.get("quantize")
        fp32_nodes: list[str] = []
        if quantize is not None:
            if custom_ops is not None:
                raise CompileError(f"{candidate.name}: models with custom ops are not quantized")
            model_path, fp32_nodes = quantize_int8(
                model_path, workdir, str(quantize), calibration,
                reduce_range=bool(config.get("reduce_range")), external=external,
                calibrate=str(config.get("calibrate", "minmax")),
                exclude=str(config.get("exclude", "")))
        engine_path = workdir / "engine.onnx"
        session_options = ort.SessionOptions()
        session_options.graph_optimization_level = getattr(
            ort.GraphOptimizationLevel, LEVEL_NAMES[level]
        )
        session_options.optimized_model_filepath = str(engine_path)
        if external:
            session_options.add_session_config_entry(
                "session.optimized_model_external_initializers_file_name", ENGINE_DATA_BLOB)
            session_options.add_session_config_entry(
                "session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        # Level 3 makes onnxruntime warn that the saved model is hardware-specific; that is
        # by design here (see the module docstring), so only errors are logged.
        session_options.log_severity_level = 3
        if custom_ops is not None:
            custom_ops.apply(session_options)
        try:
            ort.InferenceSession(str(model_path), session_options, providers=PROVIDERS)
        except Exception as exc:  # onnxruntime raises its own untyped errors
            raise CompileError(
                f"onnxruntime {ort.__version__} could not build {candidate.name} (level {level}, "
                f"{LEVEL_NAMES[level]}): {exc}",
                optimization_level=level, candidate=candidate.name,
            ) from exc
        logger.info("onnxruntime saved %s to %s", candidate.name, engine_path)
        runtime_config: dict[str, object] = {
            "graph_optimization_level": 0,
            "optimization_level": level,
            "providers": list(PROVIDERS),
            "precision": candidate.precision,
        }
        for key in ("intra_op_num_threads", "thread_policy", "execution_mode"):
            if key in config:
                runtime_config[key] = config[key]
        if quantize is not None and fp32_nodes:  # what a reader of the manifest should know
            runtime_config["fp32_nodes"] = list(fp32_nodes)
        if config.get("bf16_fastmath"):
            runtime_config["session_config"] = {"mlas.enable_gemm_fastmath_arm64_bfloat16": "1"}
        blobs = [("engine", engine_path, ENGINE_MEDIA_TYPE)]
        if external and (workdir / ENGINE_DATA_BLOB).is_file():
            blobs.append((ENGINE_DATA_BLOB, workdir / ENGINE_DATA_BLOB,
                          "application/octet-stream"))
        if custom_ops is not None:
            runtime_config["custom_ops"] = custom_ops.runtime_config()
            _check_custom_nodes(model_path, engine_path)
        return BuiltEngine(
            blobs=blobs,
            runtime_config=runtime_config,
            toolchain=toolchain_string(self.name, ort.__version__),
        )


def _custom_node_counts(path: Path) -> dict[str, int]:
    import onnx

    from schemas.onnx_model import BUILTIN_DOMAINS
    from schemas.plugins import qualified_op

    counts: dict[str, int] = {}
    for node in onnx.load(str(path), load_external_data=False).graph.node:
        if node.domain not in BUILTIN_DOMAINS and not node.domain.startswith("com.microsoft"):
            name = qualified_op(node.domain, node.op_type)
            counts[name] = counts.get(name, 0) + 1
    return counts


def _check_custom_nodes(model_path: Path, engine_path: Path) -> None:
    """Custom nodes stay opaque: onnxruntime neither fuses nor folds them. Log what the engine
    kept, and warn when a node is gone (only dead code may be removed)."""
    before, after = _custom_node_counts(model_path), _custom_node_counts(engine_path)
    logger.info("custom nodes in the engine: %s (before optimization: %s)", after, before)
    lost = {op: (n, after.get(op, 0)) for op, n in before.items() if after.get(op, 0) < n}
    if lost:
        logger.warning("onnxruntime removed custom nodes (op: before, after) %s; only nodes "
                       "whose outputs nothing uses should disappear", lost)

"""OpenVINO (CPU) backend: converts the model to OpenVINO's IR, compiles it for this CPU and
exports the compiled model (``CompiledModel.export_model``) as the engine blob; the executor
twin imports it (``Core.import_model``) without compiling again.

Input. ONNX models (external data beside the file) go through ``openvino.convert_model``;
``torch.export`` programs too (``convert_model`` takes an ``ExportedProgram``): ``from_program``
converts the checked, loaded program once per compile, in the build step, into an IR file in
the work folder with the signature's port names, and every candidate builds from that. A model
OpenVINO's front end cannot convert fails with ``UnsupportedOperator`` naming the operator
(``details["op"]``: ``ai.onnx::Det``, ``aten::foo``); in a tuning run of several backends the
other backends' candidates still compete.

Candidates, the default first (OpenVINO has no optimization levels; ``optimization_level`` is
not used):

- ``fp32-latency``: ``INFERENCE_PRECISION_HINT: f32`` under the ``LATENCY`` performance hint;
  ``fp32-throughput``: the ``THROUGHPUT`` hint (several streams, for concurrent requests).
  fp32 is asked for explicitly: on a CPU with AMX or AVX-512 BF16 the CPU plugin's default
  inference precision is bf16;
- with ``precision: auto`` (or ``bf16``): ``bf16-latency`` (``INFERENCE_PRECISION_HINT: bf16``)
  where the CPU has AMX-BF16 or AVX-512 BF16 (bf16 on aarch64), recorded as skipped elsewhere
  (the plugin would emulate it, slower than fp32);
- with ``precision: auto`` (or ``int8``): ``int8-ptq``, NNCF post-training quantization
  (``nncf.quantize``) on the calibration feeds (the samples when no calibration dataset is
  given); and ``int8-accuracy-control``, built only when ``int8-ptq`` misses the accuracy gate
  (``Candidate.fallback_of``): ``nncf.quantize_with_accuracy_control`` with the gate's own
  metric and threshold as the drop it may accept, against the fp32 model's outputs on the
  calibration feeds; it keeps the layers that hurt accuracy most in higher precision, for at
  most ``accuracy_control_iterations`` rounds (fewer for a smaller tuning budget). A model
  with a Softmax fed by a MatMul is quantized as a transformer (NNCF's ``ModelType``). The
  layers left in floating point run in bf16 where the CPU has it. Both need at least
  ``schemas.datasets.NNCF_MIN_CALIBRATION_SAMPLES`` calibration samples; a job that names this
  backend alone with fewer is refused at submit.

Every candidate is verified by the tuner like any other: fp32 element-wise within the
tolerance, bf16 and int8 by the accuracy gate.

``portability: portable`` and fp16 are refused: a compiled blob runs only under the OpenVINO
version and on the CPU ISA that compiled it (the key says both; see the executor twin), and
fp16 inference is not offered on CPU here. Intel GPUs (OpenVINO's ``GPU`` device) are out of
scope.

Custom ops: from the plugin bundle's OpenVINO extension (a native implementation for backend
``openvino``: a library made with ``OPENVINO_CREATE_EXTENSIONS``, its ops as ``ov::op::Op`` and
their ONNX conversion rules, see docs/custom-ops.md), loaded by the pipeline in the sandboxed
build like every plugin (digests, ABI tag ``ov-<N>``), added to the ``Core`` before the ONNX
model is converted (``runtime_agent.executors.openvino.custom_ops.CoreExtensions``), and recorded in
``runtime_config["custom_ops"]``; the executor adds the same library before ``import_model``.
The engine is verified against the onnxruntime reference run with the bundle's onnxruntime
kernels. The same holds when OpenVINO races as a peer in another backend's tuning run (an
onnxruntime job naming both): the pipeline loads the bundles again for ``openvino/cpu`` and
this runtime's ABI and hands this backend its own ``CoreExtensions``, so its candidates build
with the extension and an OpenVINO winner's manifest makes the agent load it. A bundle without
an OpenVINO extension for an op is refused with ``NoImplementation`` naming the op and the
targets it has (as a peer, these candidates are skipped with that reason, and one built for
another ``ov-<N>`` with ``AbiMismatch``'s). ``torch.export`` programs with custom ops are refused
(``check_program``): the PyTorch front end would need rules of its own.
"""

from __future__ import annotations

import importlib.util
import io
import logging
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from compiler_worker.backends.base import (
    Backend,
    BuildDeadline,
    BuiltEngine,
    Candidate,
    check_deadline,
    toolchain_string,
)
from runtime_agent.executors.base import CustomOpAdapter
from runtime_agent.executors.openvino.executor import (
    DEVICE,
    ENGINE_MEDIA_TYPE,
    OpenVinoExecutor,
    blob_header,
)
from runtime_agent.fingerprint import detect_cpu, isa_class, version_tuple
from schemas.datasets import NNCF_MIN_CALIBRATION_SAMPLES
from schemas.errors import (
    BackendUnavailable,
    CompileError,
    FingerprintMismatch,
    UnsupportedOperator,
)
from schemas.fingerprint import HardwareFingerprint
from schemas.manifest import TensorSpec
from schemas.options import AccuracyMetric, CompileOptions, Portability, Precision
from schemas.technologies.openvino import (
    has_bf16,
    kernel_class,
    kernel_features,
    openvino_version,
)

if TYPE_CHECKING:
    import numpy as np

    from runtime_agent.executors.openvino.custom_ops import CoreExtensions

logger = logging.getLogger(__name__)

#: Rounds of NNCF's accuracy restorer (each reverts one group of quantizers to floating point
#: and re-validates) at the default tuning budget; scaled down with the budget.
ACCURACY_CONTROL_ITERATIONS = 8
#: The IR file ``from_program`` writes.
PROGRAM_IR = "program-openvino.xml"

_UNCONVERTED = re.compile(r"No conversion rule found for operations:\s*([^\n]+)")
_HINTS = {"latency": "LATENCY", "throughput": "THROUGHPUT"}


def unconverted_ops(message: str) -> list[str]:
    """The operators an OpenVINO front end reports it has no conversion rule for
    (``"-- No conversion rule found for operations: Det-18, custom.MyOp"`` → ``["Det-18",
    "custom.MyOp"]``)."""
    match = _UNCONVERTED.search(message)
    if match is None:
        return []
    return [name.strip() for name in match.group(1).split(",") if name.strip()]


def onnx_op_names(model_path: Path, reported: Sequence[str]) -> list[str]:
    """``domain::OpType`` for each op the ONNX front end named (``Det-18`` → ``ai.onnx::Det``,
    ``custom.dom.MyOp`` → ``custom.dom::MyOp``), matched against the model's nodes."""
    import onnx

    from schemas.plugins import qualified_op

    nodes = {(node.domain, node.op_type) for node in onnx.load(
        str(model_path), load_external_data=False).graph.node}
    named = []
    for text in reported:
        bare = re.sub(r"-\d+$", "", text)
        match = next((qualified_op(d, t) for d, t in sorted(nodes)
                      if bare in (t, f"{d}.{t}")), None)
        named.append(match or bare)
    return named


def torch_op_names(reported: Sequence[str]) -> list[str]:
    """``aten::kthvalue`` for ``aten.kthvalue.default`` (and ``torch.ops.aten...``)."""
    named = []
    for text in reported:
        parts = text.removeprefix("torch.ops.").split(".")
        named.append(f"{parts[0]}::{parts[1]}" if len(parts) >= 2 else text)
    return named


def is_transformer(model: Any) -> bool:
    """Whether the OpenVINO model has attention (a Softmax fed by a MatMul): NNCF quantizes
    such models with its transformer rules."""
    for op in model.get_ordered_ops():
        if op.get_type_name() == "Softmax" and any(
                value.get_node().get_type_name() == "MatMul"
                for value in (port.get_source_output() for port in op.inputs())):
            return True
    return False


class OpenVinoBackend(Backend):
    """OpenVINO's CPU plugin; keyed by ISA class, kernel features and OpenVINO version."""

    name = "openvino"
    executor = OpenVinoExecutor
    #: Below onnxruntime: a job that names no backend and no key builds with onnxruntime; an
    #: OpenVINO engine comes from a job on this key, one that names this backend, or a tuning
    #: run that races this backend's candidates beside its primary's.
    priority = 8
    device = "cpu"
    #: OpenVINO converts every format it takes into its own IR.
    converts = frozenset({"onnx", "torch-export"})

    @property
    def model_formats(self) -> frozenset[str]:  # type: ignore[override]
        """ONNX models, and ``torch.export`` programs where torch is installed."""
        if importlib.util.find_spec("torch"):
            return frozenset({"onnx", "torch-export"})
        return frozenset({"onnx"})

    def toolchain(self) -> str:
        version = self.executor.probe_version()
        if version is None:
            raise BackendUnavailable("openvino is not installed on this worker")
        return toolchain_string(self.name, version)

    def check_options(self, options: CompileOptions) -> None:
        if options.precision is Precision.FP16:
            raise BackendUnavailable(
                f"the {self.name} CPU backend builds no fp16 engines; use precision fp32, auto, "
                f"bf16 or int8", precision=options.precision.value,
                supported=[p.value for p in Precision if p is not Precision.FP16])
        if options.portability is Portability.PORTABLE:
            raise BackendUnavailable(
                f"the {self.name} backend builds no portable engines (a compiled blob imports "
                f"only under the OpenVINO version and on the CPU ISA that compiled it); use "
                f"portability: exact")

    def check_program(self, custom_ops: set[str]) -> None:
        if custom_ops:
            raise UnsupportedOperator(
                f"the {self.name} backend converts custom ops of ONNX models only (through the "
                f"plugins' OpenVINO extensions); the torch program's {sorted(custom_ops)} would "
                f"need PyTorch front-end rules", op=sorted(custom_ops)[0],
                ops=sorted(custom_ops), backend=self.name)

    def from_program(self, program: Any, program_path: Path, workdir: Path, *,
                     inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> Path:
        """Convert the program with ``openvino.convert_model`` into ``workdir``'s IR, its
        ports named as the signature's inputs and outputs."""
        import openvino as ov

        destination = workdir / PROGRAM_IR
        model = _convert(lambda: ov.convert_model(program), what="the torch program",
                         name_ops=torch_op_names)
        _name_ports(model, inputs, outputs)
        ov.save_model(model, str(destination), compress_to_fp16=False)
        logger.info("converted the torch program to OpenVINO IR (%s)", destination.name)
        return destination

    def candidates(self, fingerprint: HardwareFingerprint,
                   options: CompileOptions) -> list[Candidate]:
        found: list[Candidate] = []

        def add(name: str, precision: str = "fp32", **config: object) -> Candidate:
            candidate = Candidate(
                name=f"{self.name}/{name}", precision=precision,
                skip=str(config.pop("skip", "")),
                needs_calibration=bool(config.pop("needs_calibration", False)),
                fallback_of=str(config.pop("fallback_of", "")), config=config)
            found.append(candidate)
            return candidate

        if options.precision in (Precision.FP32, Precision.AUTO):
            add("fp32-latency", inference_precision="f32", hint="latency")
            add("fp32-throughput", inference_precision="f32", hint="throughput")
        bf16 = has_bf16(fingerprint.cpu)
        if options.precision in (Precision.AUTO, Precision.BF16):
            add("bf16-latency", "bf16", inference_precision="bf16", hint="latency",
                skip="" if bf16 else (
                    f"this CPU ({isa_class(fingerprint.cpu)}, features "
                    f"{kernel_features(fingerprint.cpu) or 'none beyond its class'}) has "
                    f"neither AMX-BF16 nor AVX-512 BF16: OpenVINO would emulate bf16, slower "
                    f"than fp32"))
        if options.precision in (Precision.AUTO, Precision.INT8):
            rest = "bf16" if bf16 else "f32"
            ptq = add("int8-ptq", "int8-ptq", quantize="ptq", inference_precision=rest,
                      hint="latency", needs_calibration=True)
            iterations = max(1, min(ACCURACY_CONTROL_ITERATIONS,
                                    int(ACCURACY_CONTROL_ITERATIONS
                                        * options.tuning_budget_s / 300)))
            add("int8-accuracy-control", "int8-accuracy-control",
                quantize="accuracy-control", inference_precision=rest, hint="latency",
                accuracy_control_iterations=iterations, needs_calibration=True,
                fallback_of=ptq.name)
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
        try:
            import openvino as ov
        except ImportError as exc:
            raise BackendUnavailable(f"openvino is not installed on this worker: {exc}",
                                     backend=self.name) from exc
        installed = self.executor.probe_version() or ov.__version__
        host = detect_cpu()
        if fingerprint is not None:
            declared = openvino_version(fingerprint)
            if declared is None or version_tuple(declared)[:3] != version_tuple(installed)[:3]:
                raise FingerprintMismatch(
                    f"the build fingerprint declares OpenVINO "
                    f"{fingerprint.runtimes.get('openvino')}, but this worker runs OpenVINO "
                    f"{installed}; an engine built here would carry the wrong key")
            if kernel_class(fingerprint.cpu) != kernel_class(host):
                raise FingerprintMismatch(
                    f"OpenVINO compiles for the CPU it runs on: this host is "
                    f"{kernel_class(host)}, the build fingerprint declares "
                    f"{kernel_class(fingerprint.cpu)}; a blob built here would not import "
                    f"there", host=kernel_class(host), declared=kernel_class(fingerprint.cpu))
        config = dict(candidate.config)
        quantize = config.get("quantize")
        if quantize is not None and len(calibration) < NNCF_MIN_CALIBRATION_SAMPLES:
            raise CompileError(
                f"{candidate.name}: NNCF quantization needs at least "
                f"{NNCF_MIN_CALIBRATION_SAMPLES} calibration samples; {len(calibration)} were "
                f"given", minimum=NNCF_MIN_CALIBRATION_SAMPLES, given=len(calibration),
                candidate=candidate.name)
        core = ov.Core()
        libraries: list[str] = []
        if custom_ops is not None:
            extensions = cast("CoreExtensions", custom_ops)
            extensions.check_frontend("onnx" if model_path.suffix == ".onnx" else "torch-export")
            # The converter takes the ops' conversion rules; the Core compiles the ops.
            libraries = extensions.apply(core)
        model = self._read(ov, core, model_path, libraries)
        if quantize is not None:
            model = _quantize(ov, core, model, str(quantize), calibration, options,
                              iterations=int(config.get("accuracy_control_iterations", 1)),
                              candidate=candidate.name)
        hint = _HINTS[str(config.get("hint", "latency"))]
        properties = {"INFERENCE_PRECISION_HINT": str(config["inference_precision"]),
                      "PERFORMANCE_HINT": hint}
        try:
            compiled = core.compile_model(model, DEVICE, properties)
        except Exception as exc:  # OpenVINO raises its own untyped errors
            raise CompileError(
                f"OpenVINO {installed} could not compile {candidate.name} for {DEVICE}: "
                f"{type(exc).__name__}: {exc}"[:2000], candidate=candidate.name) from exc
        # What the plugin settled on is what the import must ask for again (the blob does not
        # keep it): e.g. the precision the plugin took for this CPU.
        properties["INFERENCE_PRECISION_HINT"] = compiled.get_property(
            "INFERENCE_PRECISION_HINT").get_type_name()
        engine = workdir / "engine.ovblob"
        stream = io.BytesIO()
        compiled.export_model(stream)
        blob = stream.getvalue()
        engine.write_bytes(blob)
        header = blob_header(blob[:4096])
        runtime_config: dict[str, object] = {
            "device": DEVICE,
            "openvino_version": ".".join(str(p) for p in version_tuple(installed)[:3]),
            "cpu_class": isa_class(host),
            "cpu_features": kernel_features(host),
            "cpu_isa": header[1] if header else "",
            "properties": properties,
            "precision": candidate.precision,
            "performance_hint": hint,
            "input_names": [port.get_any_name() for port in compiled.inputs],
            "output_names": [port.get_any_name() for port in compiled.outputs],
        }
        if custom_ops is not None:
            runtime_config["custom_ops"] = custom_ops.runtime_config()
        if quantize is not None:
            runtime_config["quantization"] = {
                "method": "nncf.quantize" if quantize == "ptq"
                else "nncf.quantize_with_accuracy_control",
                "calibration_samples": len(calibration)}
        logger.info("OpenVINO compiled %s (%s)", candidate.name, properties)
        return BuiltEngine(blobs=[("engine", engine, ENGINE_MEDIA_TYPE)],
                           runtime_config=runtime_config,
                           toolchain=toolchain_string(self.name, installed))

    def _read(self, ov: Any, core: Any, model_path: Path, extensions: Sequence[str] = ()) -> Any:
        """The OpenVINO model of an IR file (``from_program``'s), a ``.pt2`` archive or an ONNX
        file (converted with the extension libraries ``extensions``)."""
        if model_path.suffix == ".xml":
            return core.read_model(str(model_path))
        if model_path.suffix == ".pt2":
            import torch

            try:
                program = torch.export.load(str(model_path))
            except Exception as exc:  # torch raises its own untyped errors
                raise CompileError(f"{model_path.name} is not a torch.export archive torch "
                                   f"{torch.__version__} can load: {exc}"[:2000]) from exc
            return _convert(lambda: ov.convert_model(program), what="the torch program",
                            name_ops=torch_op_names)
        return _convert(lambda: ov.convert_model(str(model_path), extension=list(extensions)
                                                 or None), what="the ONNX model",
                        name_ops=lambda ops: onnx_op_names(model_path, ops))


def _convert(convert: Any, *, what: str, name_ops: Any) -> Any:
    """``convert()``, its failure typed: ``UnsupportedOperator`` naming the operators the
    front end has no rule for, else ``CompileError``."""
    import openvino as ov

    try:
        return convert()
    except Exception as exc:  # OpenVINO's front ends raise their own untyped errors
        reported = unconverted_ops(str(exc))
        if reported:
            ops = name_ops(reported)
            raise UnsupportedOperator(
                f"OpenVINO {ov.__version__} cannot convert {what}: no conversion rule for "
                f"{ops}, so the openvino backend cannot build it (other backends still may)",
                op=ops[0], ops=ops, backend="openvino") from exc
        raise CompileError(f"OpenVINO {ov.__version__} could not convert {what}: "
                           f"{type(exc).__name__}: {exc}"[:2000], backend="openvino") from exc


def _name_ports(model: Any, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> None:
    """Give the model's ports the signature's names, in order."""
    for what, ports, specs in (("inputs", model.inputs, inputs),
                               ("outputs", model.outputs, outputs)):
        if len(ports) != len(specs):
            raise CompileError(f"OpenVINO converted the program to a model with {len(ports)} "
                               f"{what}; its signature has {[s.name for s in specs]}")
        for port, spec in zip(ports, specs, strict=True):
            port.get_tensor().set_names({spec.name})


def _gate_value(metric: AccuracyMetric, got: Sequence[Mapping[str, Any]],
                expected: Sequence[Mapping[str, Any]]) -> float:
    """The gate's figure as NNCF wants it: higher is better, and never 0 for a perfect
    engine (NNCF divides by the original model's figure): ``1 - max_abs`` for ``max_abs``."""
    from compiler_worker.tuner import accuracy
    from schemas.options import AccuracyGate

    value = accuracy(AccuracyGate(metric=metric, threshold=0), got, expected)
    return 1.0 - value if metric is AccuracyMetric.MAX_ABS else value


def _quantize(ov: Any, core: Any, model: Any, method: str,
              calibration: list[Mapping[str, np.ndarray]], options: CompileOptions, *,
              iterations: int, candidate: str) -> Any:
    """The int8 model NNCF makes of ``model`` (``ptq`` or ``accuracy-control``)."""
    try:
        import nncf
        from nncf.quantization.advanced_parameters import AdvancedAccuracyRestorerParameters
    except ImportError as exc:
        raise BackendUnavailable(f"nncf is not installed on this worker: {exc}",
                                 backend="openvino") from exc
    feeds = [dict(feed) for feed in calibration]
    dataset = nncf.Dataset(feeds)
    model_type = nncf.ModelType.TRANSFORMER if is_transformer(model) else None
    started = time.perf_counter()
    try:
        if method == "ptq":
            quantized = nncf.quantize(model, dataset, subset_size=len(feeds),
                                      model_type=model_type)
        else:
            gate = options.accuracy
            reference = core.compile_model(model, DEVICE, {"INFERENCE_PRECISION_HINT": "f32"})
            names = [port.get_any_name() for port in reference.outputs]

            def outputs(compiled: Any, feed: Mapping[str, Any]) -> dict[str, Any]:
                return dict(zip(names, compiled(feed).values(), strict=True))

            expected = {id(feed): outputs(reference, feed) for feed in feeds}

            def validate(compiled: Any, data: Any) -> tuple[float, list[float]]:
                # The gate's figure over the items, and each item's own (NNCF ranks the
                # quantizers it may revert by the per-item figures). The restorer validates
                # once per quantizer group it ranks and once per round: the one place it
                # comes back to us, so the place its run is held to the tuning budget.
                check_deadline(f"NNCF's accuracy-aware quantization of {candidate}")
                items = list(data)
                got = [outputs(compiled, f) for f in items]
                want = [expected[id(f)] if id(f) in expected else outputs(reference, f)
                        for f in items]
                return (_gate_value(gate.metric, got, want),
                        [_gate_value(gate.metric, [g], [w]) for g, w in zip(got, want,
                                                                            strict=True)])

            # NNCF measures the drop from the original model as its own engine runs it (the
            # CPU plugin's default precision: bf16 where the CPU has it); the drop it may take
            # is what keeps the gate against the fp32 reference.
            target = 1.0 - gate.threshold if gate.metric is AccuracyMetric.MAX_ABS \
                else gate.threshold
            initial, _ = validate(core.compile_model(model, DEVICE), feeds)
            max_drop = max(0.0, initial - target)
            quantized = nncf.quantize_with_accuracy_control(
                model, calibration_dataset=dataset, validation_dataset=dataset,
                validation_fn=validate, max_drop=max_drop, drop_type=nncf.DropType.ABSOLUTE,
                subset_size=len(feeds), model_type=model_type,
                advanced_accuracy_restorer_parameters=AdvancedAccuracyRestorerParameters(
                    max_num_iterations=iterations, ranking_subset_size=len(feeds),
                    # One worker: the sandboxed build has no cores to spare for more.
                    num_ranking_workers=1))
    except BuildDeadline:
        raise
    except Exception as exc:  # NNCF raises its own untyped errors
        if isinstance(exc.__cause__ or exc.__context__, BuildDeadline):
            raise (exc.__cause__ or exc.__context__) from exc
        raise CompileError(f"NNCF could not quantize {candidate} ({method}): "
                           f"{type(exc).__name__}: {exc}"[:2000], candidate=candidate) from exc
    logger.info("NNCF %s quantized %s in %.1f s on %d samples", method, candidate,
                time.perf_counter() - started, len(feeds))
    return quantized

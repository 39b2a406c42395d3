"""ONNX's own backend test models, compiled by Kiln and checked against their shipped outputs.

Three sources, all shipped inside the installed ``onnx`` package (nothing is downloaded):

* ``light``: the light model zoo (AlexNet, ResNet-50, VGG-19, ...; opset 9). Their inputs are
  generated the way ONNX's backend runner does (``arange / n``), the expected outputs shipped
  as ``light_<name>_output_0.pb``.
* ``pytorch-converted`` and ``pytorch-operator``: small PyTorch modules at opset 6 (below what
  onnxruntime loads, so Kiln converts them), each with ``test_data_set_*/input_*.pb`` and
  ``output_*.pb``.
* ``node``: the single-operator tests, generated in-process by ``onnx.backend.test.case``
  (the wheel ships their generators, not their files); a deterministic sample of them.

Each case is compiled in-process by ``compile_model`` (``tune="off"``), written with
``write_artifact_dir``, loaded with ``load_executor`` exactly as an agent loads it, fed the
shipped inputs, and compared with the shipped outputs (``rtol``/``atol`` as ONNX's backend
tests: 1e-3 / 1e-7, the light zoo 1e-3 / 1e-5). A model plain onnxruntime cannot load or run
(after the opset conversion Kiln itself would do), or whose plain onnxruntime outputs already
differ from the test data, is not Kiln's to pass: it is skipped with that reason. A model
whose graph inputs or outputs are not tensors (sequences, maps, optionals) is ``unsupported``:
Kiln's engines take and return tensors by design, and refuse such a model with a typed error.
"""

from __future__ import annotations

import glob
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

#: Every ``NODE_STRIDE``-th single-operator test (sorted by name) is in the sample.
NODE_STRIDE = 4
LIGHT_TOLERANCE = (1e-3, 1e-5)
#: What Kiln says of a model whose graph inputs or outputs are sequences, maps or optionals.
NOT_TENSORS = "Kiln compiles models whose inputs and outputs are tensors"
DEFAULT_TOLERANCE = (1e-3, 1e-7)
#: How a backend's refusal of an operator it cannot convert begins (its error code).
UNSUPPORTED_OPERATOR = "unsupported_operator:"


def data_root() -> Path:
    return Path(onnx.__file__).parent / "backend" / "test" / "data"


@dataclass
class Case:
    """One model with its feeds and expected outputs (in graph input/output order)."""

    suite: str
    name: str
    model: onnx.ModelProto
    data_sets: list[tuple[list[object], list[object]]]
    rtol: float = DEFAULT_TOLERANCE[0]
    atol: float = DEFAULT_TOLERANCE[1]

    @property
    def id(self) -> str:
        return f"{self.suite}/{self.name}"


@dataclass
class Outcome:
    case: str
    status: str  # passed | failed | skipped | unsupported
    reason: str = ""
    seconds: float = 0.0
    details: dict[str, object] = field(default_factory=dict)


def _read_pb(path: Path) -> np.ndarray:
    tensor = onnx.TensorProto()
    tensor.ParseFromString(path.read_bytes())
    return numpy_helper.to_array(tensor)


def _dummy_input(value: onnx.ValueInfoProto) -> np.ndarray:
    """ONNX's backend runner's input for a light zoo model (``random=False``)."""
    shape = tuple(d.dim_value if d.HasField("dim_value") else 1
                  for d in value.type.tensor_type.shape.dim)
    n = int(np.prod(shape))
    return (np.arange(n).reshape(shape) / n).astype(np.float32)


def light_cases() -> Iterator[Case]:
    for path in sorted((data_root() / "light").glob("light_*.onnx")):
        model = onnx.load(str(path))
        weights = {init.name for init in model.graph.initializer}
        feeds = [_dummy_input(v) for v in model.graph.input if v.name not in weights]
        outputs = [_read_pb(path.with_name(f"{path.stem}_output_{i}.pb"))
                   for i in range(len(model.graph.output))]
        yield Case("light", path.stem.removeprefix("light_"), model, [(feeds, outputs)],
                   *LIGHT_TOLERANCE)


def directory_cases(suite: str) -> Iterator[Case]:
    for directory in sorted((data_root() / suite).iterdir()):
        model_path = directory / "model.onnx"
        if not model_path.is_file():
            continue
        data_sets = []
        for data_dir in sorted(directory.glob("test_data_set_*")):
            inputs = [_read_pb(Path(p)) for p in sorted(glob.glob(str(data_dir / "input_*.pb")))]
            outputs = [_read_pb(Path(p))
                       for p in sorted(glob.glob(str(data_dir / "output_*.pb")))]
            data_sets.append((inputs, outputs))
        yield Case(suite, directory.name, onnx.load(str(model_path)), data_sets)


def node_cases(stride: int = NODE_STRIDE) -> Iterator[Case]:
    import warnings

    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        cases = sorted(collect_testcases(None), key=lambda c: c.name)
    for case in cases[::stride]:
        if case.model is None or not case.data_sets:
            continue
        yield Case("node", case.name, case.model,
                   [([_normalize(v) for v in i], [_normalize(v) for v in o])
                    for i, o in case.data_sets], case.rtol, case.atol)


def _normalize(value: object) -> object:
    """A test value as onnxruntime takes it: numpy scalars as 0-d arrays, TensorProtos (the
    float8/int4 data) as arrays; sequences and maps as they are."""
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    if isinstance(value, np.generic):
        return np.asarray(value)
    return value


def all_cases() -> list[Case]:
    return [*light_cases(), *directory_cases("pytorch-converted"),
            *directory_cases("pytorch-operator"), *node_cases()]


def _feed(model: onnx.ModelProto, inputs: list[object]) -> dict[str, object]:
    weights = {init.name for init in model.graph.initializer}
    names = [v.name for v in model.graph.input if v.name not in weights]
    return dict(zip(names, inputs, strict=False))


def _compare(got: list[object], expected: list[object], rtol: float, atol: float) -> str | None:
    """``None`` when every output matches, else what differs."""
    if len(got) != len(expected):
        return f"{len(got)} outputs, expected {len(expected)}"
    for index, (g, e) in enumerate(zip(got, expected, strict=True)):
        g, e = np.asarray(g), np.asarray(e)
        if g.shape != e.shape:
            return f"output {index}: shape {g.shape}, expected {e.shape}"
        if e.dtype.kind in "OSUb" or g.dtype.kind in "OSUb":
            if not np.array_equal(g, e):
                return f"output {index}: values differ"
            continue
        try:
            np.testing.assert_allclose(g.astype(np.float64), e.astype(np.float64), rtol=rtol,
                                       atol=atol, equal_nan=True)
        except AssertionError as exc:
            lines = [ln.strip() for ln in str(exc).splitlines() if "Max" in ln]
            return f"output {index}: " + "; ".join(lines)
    return None


def _ort_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model as plain onnxruntime would get it: converted to opset 7 when older (the one
    rewrite Kiln itself makes before onnxruntime sees it)."""
    from compiler_worker.modelio import default_opset

    if default_opset(model) >= 7:
        return model
    from onnx import version_converter

    return version_converter.convert_version(model, 7)


def onnxruntime_verdict(case: Case) -> str | None:
    """Why plain onnxruntime is not a fair bar for this case (``None``: it runs and matches)."""
    import onnxruntime as ort

    try:
        model = _ort_model(case.model)
        session = ort.InferenceSession(model.SerializeToString(),
                                       providers=["CPUExecutionProvider"])
    except Exception as exc:
        return f"not runnable by onnxruntime: cannot load ({_short(exc)})"
    names = [o.name for o in session.get_outputs()]
    for inputs, expected in case.data_sets:
        try:
            got = session.run(names, _feed(model, inputs))
        except Exception as exc:
            return f"not runnable by onnxruntime: cannot run ({_short(exc)})"
        if _compare(got, expected, case.rtol, case.atol) is not None:
            return "onnxruntime's own outputs differ from the test data"
    return None


def openvino_verdict(case: Case) -> str | None:
    """Why plain OpenVINO is not a fair bar for this case on this CPU (``None``: it runs and
    matches): its CPU plugin, asked for f32, gives other numbers than the test data (seen on
    some ISAs only), so Kiln's refusal of its engine is the right answer there."""
    import openvino as ov

    try:
        core = ov.Core()
        compiled = core.compile_model(core.read_model(_ort_model(case.model).SerializeToString(),
                                                      b""),
                                      "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    except Exception as exc:
        return f"not runnable by OpenVINO: cannot compile ({_short(exc)})"
    for inputs, expected in case.data_sets:
        try:
            result = compiled(_feed(case.model, inputs))
            got = [np.asarray(result[port]) for port in compiled.outputs]
        except Exception as exc:
            return f"not runnable by OpenVINO: cannot run ({_short(exc)})"
        problem = _compare(got, expected, case.rtol, case.atol)
        if problem is not None:
            return f"OpenVINO's own f32 outputs differ from the test data on this CPU: {problem}"
    return None


def _short(exc: BaseException, limit: int = 110) -> str:
    text = " ".join(str(exc).split())
    for prefix in ("[ONNXRuntimeError] : ", "1 : FAIL : ", "10 : INVALID_GRAPH : ",
                   "9 : NOT_IMPLEMENTED : ", "2 : INVALID_ARGUMENT : "):
        text = text.replace(prefix, "")
    return f"{type(exc).__name__}: {text[:limit]}"


def run_case(case: Case, fingerprint, workdir: Path | None = None, *,
             backend: str | None = None) -> Outcome:
    """Compile ``case`` with Kiln (with ``backend`` only, when given: the same verification
    rules) and check the engine against the shipped outputs; a failure is a skip when plain
    onnxruntime cannot do better (``onnxruntime_verdict``), or, for ``openvino``, plain
    OpenVINO cannot (``openvino_verdict``). A model ``backend`` cannot convert
    is ``unsupported`` with the operator it names (its typed ``unsupported_operator``)."""
    start = time.perf_counter()
    outcome = _compile_and_compare(case, fingerprint, workdir, backend)
    outcome.seconds = time.perf_counter() - start
    if outcome.status == "failed" and NOT_TENSORS in outcome.reason:
        outcome.status = "unsupported"  # by design: engines take and give tensors
        return outcome
    if outcome.status == "failed" and outcome.reason.startswith(UNSUPPORTED_OPERATOR):
        outcome.status = "unsupported"  # that backend's typed refusal; others still compete
        return outcome
    if outcome.status == "failed":
        verdict = onnxruntime_verdict(case)
        if verdict is None and backend == "openvino":
            verdict = openvino_verdict(case)
        if verdict is not None:
            return Outcome(case.id, "skipped", verdict, outcome.seconds,
                           {"kiln": outcome.reason})
    return outcome


def _samples(case: Case) -> dict[str, np.ndarray] | None:
    """The shipped inputs as a samples dataset (``[samples, *shape]`` per input), or ``None``
    when they do not stack (data sets of different shapes, non-tensor inputs)."""
    feeds = [_feed(case.model, inputs) for inputs, _ in case.data_sets]
    try:
        stacked = {name: np.stack([np.asarray(feed[name]) for feed in feeds])
                   for name in feeds[0]}
    except (ValueError, KeyError):
        return None
    # Strings as ONNX's string tensors are: object arrays (numpy would make them '<U...').
    return {name: a.astype(object) if a.dtype.kind in "US" else a for name, a in stacked.items()}


def _compile_and_compare(case: Case, fingerprint, workdir: Path | None,
                         backend: str | None = None) -> Outcome:
    """Compile with generated inputs (Kiln's default); when that fails (a model whose inputs
    must hold particular values: shapes, axes, indices, non-zero divisors), compile again with
    the shipped inputs as the samples dataset, as a user of such a model would."""
    generated = _compile_once(case, fingerprint, workdir, samples=None, backend=backend)
    if generated.status != "failed" or generated.reason.startswith("engine output"):
        return generated
    samples = _samples(case)
    if samples is None:
        return generated
    retried = _compile_once(case, fingerprint, workdir, samples=samples, backend=backend)
    retried.details["generated_inputs"] = generated.reason
    if retried.status == "passed":
        retried.reason = "verified on the shipped inputs as samples"
    return retried


def _compile_once(case: Case, fingerprint, workdir: Path | None,
                  samples: dict[str, np.ndarray] | None, backend: str | None = None) -> Outcome:
    from compiler_worker.pipeline import compile_model, write_artifact_dir
    from runtime_agent.executors import load_executor
    from schemas.options import CompileOptions, ShapeProfile

    first_inputs = case.data_sets[0][0]
    shapes = {}
    for name, value in _feed(case.model, first_inputs).items():
        if not isinstance(value, np.ndarray):
            continue  # a sequence or a map: Kiln refuses the model, with its own reason
        shape = list(value.shape)
        if shape and all(d >= 1 for d in shape):
            shapes[name] = ShapeProfile(min=shape, opt=shape, max=shape)
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        try:
            options = CompileOptions(tune="off", verify_samples=1, benchmark_iterations=1,
                                     shapes=shapes, backends=[backend] if backend else [])
            result = compile_model(case.model.SerializeToString(), options,
                                   fingerprint=fingerprint, workdir=Path(tmp) / "work",
                                   samples=samples)
            if backend is not None and result.manifest.backend != backend:
                return Outcome(case.id, "failed", f"built by {result.manifest.backend}, not "
                               f"{backend}")
            artifact = write_artifact_dir(result, Path(tmp) / "artifact")
            executor = load_executor(artifact, result.manifest)
            names = [spec.name for spec in result.manifest.outputs]
            for inputs, expected in case.data_sets:
                outputs = executor.run(_feed(case.model, inputs))
                problem = _compare([outputs[n] for n in names], expected, case.rtol, case.atol)
                if problem is not None:
                    return Outcome(case.id, "failed", f"engine output: {problem}")
        except Exception as exc:
            code = getattr(exc, "code", None)
            reason = f"{getattr(code, 'value', code) or type(exc).__name__}: " \
                     f"{' '.join(str(exc).split())[:300]}"
            return Outcome(case.id, "failed", reason)
    return Outcome(case.id, "passed", "", 0.0, {"passes": result.manifest.passes})

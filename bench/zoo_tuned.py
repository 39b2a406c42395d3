"""Kiln's tuner on models nobody here wrote: models the ``onnx`` package ships (its light zoo),
tuned at ``precision: fp32`` with every backend this machine has competing, then the engine
re-timed beside what a user builds by hand from the same file: onnxruntime at level 3,
OpenVINO fp32 (LATENCY hint, pinned to f32), and onnxruntime's dynamic int8 where
``quantize_dynamic`` takes the model. Interleaved blocks in one process, each after the
runtimes' spin gap (``bench._common.blocks``); the cosine of each engine's output against
onnxruntime's; the ratio to the fastest fp32 peer whose cosine is at least 0.9999 (a peer
whose outputs are wrong is no peer); the host's load around the timing.

    .venv/bin/python bench/zoo_tuned.py
    .venv/bin/python bench/zoo_tuned.py --models light_densenet121 --rounds 20
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from _common import blocks, console, fmt
from rich.table import Table

from compiler_worker.benchmark import sample_host
from compiler_worker.pipeline import compile_model, write_artifact_dir
from kiln.examples import onnx_test_model
from runtime_agent.executors import load_executor
from runtime_agent.fingerprint import detect_fingerprint
from schemas.options import CompileOptions

#: The cosine a peer's output must reach to count as the same fp32 answer.
SAME_ANSWER = 0.9999


def _peers(path: Path, work: Path, feed: dict) -> tuple[dict, dict[str, str]]:
    """Each by-hand engine's call on ``feed``, and why one could not be built."""
    import onnxruntime as ort
    import openvino as ov
    from onnxruntime.quantization import quantize_dynamic

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    l3 = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    compiled = ov.Core().compile_model(ov.convert_model(str(path)), "CPU", {
        "PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32"})
    request = compiled.create_infer_request()
    calls = {"ort L3": lambda: l3.run(None, feed)[0],
             "ov fp32": lambda: request.infer(feed)[0]}
    failed = {}
    try:
        quantize_dynamic(str(path), str(work / "int8.onnx"))
        int8 = ort.InferenceSession(str(work / "int8.onnx"), providers=["CPUExecutionProvider"])
        calls["ort int8 dynamic"] = lambda: int8.run(None, feed)[0]
    except Exception as exc:  # onnxruntime.quantization raises untyped errors: reported
        failed["ort int8 dynamic"] = str(exc)[:120]
    return calls, failed


def run_model(name: str, args: argparse.Namespace) -> None:
    import numpy as np
    import onnxruntime as ort

    model = onnx_test_model(name)
    work = Path(tempfile.mkdtemp(prefix="kiln-zoo-tuned-"))
    path = work / "model.onnx"
    path.write_bytes(model.SerializeToString())
    started = time.perf_counter()
    result = compile_model(path.read_bytes(), CompileOptions(precision="fp32", tune="auto"),
                           fingerprint=detect_fingerprint(), workdir=work / "build",
                           benchmark_lock=work / "bench.lock")
    tuning_s = time.perf_counter() - started
    engine = load_executor(write_artifact_dir(result, work / "artifact"), result.manifest)
    first = result.manifest.outputs[0].name
    inputs = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).get_inputs()
    rng = np.random.default_rng(0)
    feed = {i.name: rng.standard_normal([d if isinstance(d, int) else 1 for d in i.shape])
            .astype(np.float32) for i in inputs}
    calls, failed = _peers(path, work, feed)
    calls = {"kiln": lambda: engine.run(feed)[first], **calls}
    reference = np.ravel(calls["ort L3"]()).astype(np.float64)

    def cosine(output) -> float:
        out = np.ravel(np.asarray(output)).astype(np.float64)
        return float(out @ reference / (np.linalg.norm(out) * np.linalg.norm(reference)))

    same = {label: cosine(call()) for label, call in calls.items()}
    before = sample_host(0.5)
    samples = blocks(calls, rounds=args.rounds, block=args.block)
    after = sample_host(0.5)
    fp32 = [label for label in ("ort L3", "ov fp32") if same[label] >= SAME_ANSWER]
    best = min(statistics.median(samples[label]) for label in fp32)
    noise = result.manifest.tuning.noise
    table = Table(title=f"{name}: won {result.manifest.tuning.winner}, tuning {tuning_s:.0f} s, "
                        f"{noise.measurements} measurement(s); {args.rounds} rounds x "
                        f"{args.block} calls")
    for column in ("engine", "ms per call, median [min–max]", "cosine vs ort L3",
                   "vs best fp32 peer"):
        table.add_column(column)
    for label, values in samples.items():
        table.add_row(label, fmt(values, 1000.0, "ms"), f"{same[label]:.5f}",
                      f"{statistics.median(values) / best:.2f}")
    for label, why in failed.items():
        table.add_row(label, "not built", "", why)
    console.print(table)
    console.print(f"  host while timing: other processes {before.busy:.0%} before, "
                  f"{after.busy:.0%} after; steal {max(before.steal, after.steal):.0%}; "
                  f"tuner's verdict: {noise.verdict}", markup=False, highlight=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="light_squeezenet,light_inception_v1,"
                                            "light_densenet121")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--block", type=int, default=10, help="timed calls per engine per round")
    args = parser.parse_args()
    import onnxruntime

    onnxruntime.set_default_logger_severity(4)
    for name in args.models.split(","):
        run_model(name.strip(), args)


if __name__ == "__main__":
    main()

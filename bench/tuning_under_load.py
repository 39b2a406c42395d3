"""Kiln's tuner on a loaded worker, its engine then timed on the quiet machine.

The issue this answers: tuned while other processes shared the worker's cores, the tuner once
picked a one-thread engine (its rivals' thread pools were contended) that then ran 1.86x
slower than plain onnxruntime on the quiet machine, and froze that thread count for the fleet.

Per model: CPU burners (other processes, one per core) load the machine; ``compile_model``
tunes the model as a worker would (``precision: fp32``, ``tune: auto``, every backend this
machine has competing); the burners stop; then, on the quiet machine, Kiln's engine (loaded
from its artifact as an agent loads it) is timed against the best fp32 peer a user would reach
for without Kiln: plain ``onnxruntime.InferenceSession`` at every optimization level with
its default threads, and OpenVINO fp32 under the LATENCY hint, in interleaved blocks (the
order reversed every other round) so drift hits every engine alike. All run in this one
process (``bench/engines.py`` gives each engine a process of its own). The table gives median
[min-max] ms per call and the ratio to the best peer; below it, what the tuner recorded about
the noise it saw and its verdict.

    .venv/bin/python bench/tuning_under_load.py                      # mlp 3x1024 and ResNet-50
    .venv/bin/python bench/tuning_under_load.py --models mlp --rounds 5 --block 20
    .venv/bin/python bench/tuning_under_load.py --burners 0          # the same on a quiet machine
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import blocks, console, fmt

LEVELS = {0: "ORT_DISABLE_ALL", 1: "ORT_ENABLE_BASIC", 2: "ORT_ENABLE_EXTENDED",
          3: "ORT_ENABLE_ALL"}


def _burn(stop) -> None:  # a CPU burner: another process on the worker's cores
    while not stop.is_set():
        pass


def _peers(model_path: Path, feed: dict) -> dict[str, object]:
    """Each peer's call on ``feed``: onnxruntime at every level, and OpenVINO fp32 (pinned to
    f32: on a CPU with AMX or AVX-512 BF16 the plugin's own default is bf16) where OpenVINO is
    installed."""
    import onnxruntime as ort

    calls = {}
    for level, name in LEVELS.items():
        options = ort.SessionOptions()
        options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, name)
        options.log_severity_level = 3
        session = ort.InferenceSession(str(model_path), options,
                                       providers=["CPUExecutionProvider"])
        calls[f"ort L{level} (default threads)"] = lambda s=session: s.run(None, feed)
    try:
        import openvino as ov
    except ImportError:
        return calls
    compiled = ov.Core().compile_model(ov.convert_model(str(model_path)), "CPU", {
        "PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32"})
    request = compiled.create_infer_request()
    calls["ov fp32 (LATENCY hint)"] = lambda: request.infer(feed)
    return calls


def run_model(name: str, args: argparse.Namespace) -> None:
    import numpy as np

    from compiler_worker.pipeline import compile_model, write_artifact_dir
    from kiln.architectures import exported
    from kiln.model_files import model_blob
    from runtime_agent.executors import load_executor
    from runtime_agent.fingerprint import detect_fingerprint
    from schemas.options import CompileOptions

    model = exported(name, args.cache, size="full")
    feed = {k: np.ascontiguousarray(v) for k, v in model.architecture.inputs.items()}
    work = Path(tempfile.mkdtemp(prefix="kiln-under-load-"))
    blob = model_blob(model.path, work / "model-blob").read_bytes()
    options = CompileOptions(precision="fp32", tune="auto", tuning_budget_s=args.budget)

    context = multiprocessing.get_context("spawn")
    stop = context.Event()
    burners = [context.Process(target=_burn, args=(stop,)) for _ in range(args.burners)]
    for burner in burners:
        burner.start()
    try:
        started = time.perf_counter()
        result = compile_model(blob, options, fingerprint=detect_fingerprint(),
                               workdir=work / "build",
                               benchmark_lock=work / "bench.lock")
        tuning_s = time.perf_counter() - started
    finally:
        stop.set()
        for burner in burners:
            burner.join(10)
    artifact = write_artifact_dir(result, work / "artifact")
    manifest = result.manifest
    time.sleep(args.settle)  # the burners' load fades from the machine

    engine = load_executor(artifact, manifest)
    kiln = f"kiln ({manifest.tuning.winner})"
    paths = {kiln: lambda: engine.run(feed)}
    paths.update(_peers(model.path, feed))
    from compiler_worker.benchmark import CpuSampler
    from compiler_worker.tuner_measure import (
        BUSY_THRESHOLD,
        MIN_SAMPLE_S,
        STEAL_THRESHOLD,
        is_quiet,
    )

    sampler = CpuSampler()  # every engine runs in this process: what it counts is the others'
    sampler.start()
    samples = blocks(paths, rounds=args.rounds, block=args.block)
    share = sampler.stop()
    best_peer = min((n for n in paths if n != kiln), key=lambda n: statistics.median(samples[n]))
    best = statistics.median(samples[best_peer])

    table_title = (f"{name}: tuned under {args.burners} CPU burner(s) in {tuning_s:.0f} s, "
                   f"timed on the quiet machine ({args.rounds} rounds x {args.block} calls)")
    from rich.table import Table

    table = Table(title=table_title)
    for column in ("engine", "median [min–max]", "ratio to the best fp32 peer"):
        table.add_column(column)
    for label, values in samples.items():
        table.add_row(label, fmt(values, 1000.0, "ms"),
                      f"{statistics.median(values) / best:.2f}x"
                      + (" (best peer)" if label == best_peer else ""))
    console.print(table)
    loaded = not is_quiet(share.busy, share.steal)
    console.print(f"  while timing: other processes {share.busy:.0%} of the CPU, steal "
                  f"{share.steal:.0%} over {share.seconds:.0f} s (thresholds "
                  f"{BUSY_THRESHOLD:.0%} / {STEAL_THRESHOLD:.0%})"
                  + (" — **loaded: measure again on a quiet machine**" if loaded else " — quiet"),
                  markup=False, highlight=False)
    noise = manifest.tuning.noise
    if noise is not None:
        busy = [s.busy for s in noise.samples if s.seconds >= MIN_SAMPLE_S]
        console.print(f"  tuner saw: busy {min(busy, default=0):.2f}-{max(busy, default=0):.2f} "
                      f"of the host, steal up to {max(s.steal for s in noise.samples):.2f}, "
                      f"load average up to {max(s.loadavg for s in noise.samples):.2f}; "
                      f"{noise.measurements} measurement(s); verdict: {noise.verdict}",
                      markup=False, highlight=False)
    for c in manifest.tuning.candidates:
        console.print(f"  {c.name}: {c.outcome.value}"
                      + (f", p50 {c.p50_ms:.3f} ms under load" if c.p50_ms else "")
                      + (f" ({c.reason})" if c.reason and c.outcome.value != "slower" else ""),
                      markup=False, highlight=False)
    console.print(f"  engine runtime_config: {manifest.runtime_config}", markup=False,
                  highlight=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,resnet50",
                        help="comma-separated kiln.architectures names")
    parser.add_argument("--burners", type=int, default=os.cpu_count() or 1,
                        help="CPU burner processes while tuning (default: one per core)")
    parser.add_argument("--budget", type=float, default=300.0, help="tuning budget, seconds")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--block", type=int, default=20, help="timed calls per engine per round")
    parser.add_argument("--settle", type=float, default=2.0,
                        help="seconds between stopping the burners and timing")
    parser.add_argument("--cache", type=Path, default=Path(".kiln") / "bench-models",
                        help="where exported models are cached")
    args = parser.parse_args()
    for name in args.models.split(","):
        run_model(name.strip(), args)


if __name__ == "__main__":
    main()

"""Dynamic batching through unmodified perf_analyzer, against the agent's inference server.

One engine (ResNet-50 on CPU by default, exported as ``bench/serving.py`` exports it, its
batch axis then made dynamic: ``dynamic_batch``; ``--mlp`` for the small MLP, a quick smoke
run) served twice by the agent's REST and gRPC servers in a child
process: as ``plain`` (every request alone) and as ``batched`` (a batching policy: maximum
batch 16, queue delay ``--delay-us``, ``--instances`` engine instances). perf_analyzer runs
against each over HTTP and gRPC at concurrency 1, 4 and 16; the table gives throughput and
p50/p99 latency per row, each the median [min–max] over ``--rounds`` runs interleaved
between the two models. Under it, what the batcher adds to a lone client at queue delay 0:
``inference.run`` in process, with and without the batcher, median and p10–p90 per call; and
the engine alone at batch 1 and 16 (``engine_ceiling``): the most any batcher can give here.

    .venv/bin/python bench/batching.py            # ResNet-50
    .venv/bin/python bench/batching.py --mlp      # smoke run

perf_analyzer is the binary tritonclient installs (``.venv/bin/perf_analyzer``); it needs
``libb64-0d`` (Debian) and ``libcudart.so.12`` (the ``nvidia-cuda-runtime-cu12`` wheel, found
here under the venv's ``nvidia/cuda_runtime/lib``).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import free_port
from serving import cached_compile

from schemas.options import CompileOptions

VENV = Path(sys.executable).parent
CONCURRENCY = (1, 4, 16)


def serve(artifact: str, http_port: int, grpc_port: int, delay_us: int, instances: int) -> None:
    """The agent's servers over ``plain`` and ``batched``, until stdin closes."""
    from runtime_agent.artifact_dir import load_artifact
    from runtime_agent.grpc_server import GrpcServer
    from runtime_agent.server import ServerThread, create_app
    from runtime_agent.serving import ModelTable, ServedModel
    from schemas.deployments import BatchingPolicy

    executor = load_artifact(Path(artifact))
    models = ModelTable()
    models.put(ServedModel("plain", executor))
    models.put(ServedModel("batched", executor, batching=BatchingPolicy(
        max_batch_size=16, max_queue_delay_us=delay_us, instances=instances)))
    if models.get("batched").batcher is None:
        raise SystemExit("the engine's first axis is not a dynamic batch on every input and "
                         "output: it cannot be batched")
    app = create_app(models)
    http = ServerThread(app, "127.0.0.1", http_port)
    http.start()
    grpc = GrpcServer(models, app.state.metrics, "127.0.0.1", grpc_port, workers=32)
    grpc.start()
    print("ready", flush=True)
    sys.stdin.read()
    grpc.stop()
    http.stop()


def perf_env() -> dict[str, str]:
    env = dict(os.environ)
    found = list((VENV.parent / "lib").glob("python3*/site-packages/nvidia/cuda_runtime/lib"))
    if found:
        env["LD_LIBRARY_PATH"] = ":".join([str(found[0]), env.get("LD_LIBRARY_PATH", "")])
    return env


def perf_analyzer(model: str, port: int, protocol: str, concurrency: int, shape: str,
                  window_ms: int, stability: int, work: Path) -> dict[str, float]:
    """One perf_analyzer run at ``concurrency``: throughput (infer/s), p50 and p99 (ms)."""
    out = work / f"{model}-{protocol}-{concurrency}.csv"
    command = [str(VENV / "perf_analyzer"), "-m", model, "-u", f"127.0.0.1:{port}",
               "-i", protocol, "--concurrency-range", f"{concurrency}:{concurrency}",
               "--measurement-interval", str(window_ms), "--stability-percentage",
               str(stability), "--max-trials", "10", "-f", str(out)]
    if shape:
        command += ["--shape", shape]
    done = subprocess.run(command, capture_output=True, text=True, env=perf_env(),
                          timeout=600, check=False)
    if done.returncode != 0:
        raise SystemExit(f"perf_analyzer failed ({' '.join(command)}):\n{done.stdout[-3000:]}"
                         f"\n{done.stderr[-2000:]}")
    with out.open() as handle:
        row = next(csv.DictReader(handle))
    return {"throughput": float(row["Inferences/Second"]),
            "p50": float(row["p50 latency"]) / 1000, "p99": float(row["p99 latency"]) / 1000}


def _spread(values: list[float], digits: int) -> str:
    return (f"{statistics.median(values):.{digits}f} "
            f"[{min(values):.{digits}f}–{max(values):.{digits}f}]")


def lone_client_overhead(artifact: Path, feed: dict[str, np.ndarray], calls: int) -> None:
    """p50 per call of ``inference.run`` with and without the batcher (queue delay 0)."""
    from runtime_agent import inference
    from runtime_agent.artifact_dir import load_artifact
    from runtime_agent.serving import ModelTable, ServedModel
    from schemas.deployments import BatchingPolicy

    executor = load_artifact(artifact)
    metrics = inference.Metrics(ModelTable())
    models = {"plain": ServedModel("plain", executor),
              "batched": ServedModel("batched", executor, batching=BatchingPolicy(
                  max_batch_size=16, max_queue_delay_us=0))}
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(calls):  # interleaved, so both see the same load
        for name, model in models.items():
            start = time.perf_counter()
            inference.run(model, lambda: feed, metrics)
            times[name].append(time.perf_counter() - start)
    p = {name: np.percentile(values, [10, 50, 90]) * 1e6 for name, values in times.items()}
    print(f"\nlone client, queue delay 0, in process ({calls} interleaved calls each; µs):")
    for name, (p10, p50, p90) in p.items():
        print(f"  {name:8s} p50 {p50:10.1f}  [p10 {p10:.1f} – p90 {p90:.1f}]")
    print(f"  batcher adds {p['batched'][1] - p['plain'][1]:+.1f} µs at p50 "
          f"(ratio {p['batched'][1] / p['plain'][1]:.3f})")


def engine_ceiling(artifact: Path, feed: dict[str, np.ndarray], *, rounds: int) -> None:
    """The engine alone, in process: inferences per second at batch 1 and at batch 16,
    interleaved. No batcher serves more than the engine does at the batch it forms, so the
    ratio is the most dynamic batching can give on this machine: a CPU whose kernels are
    already busy at batch 1 gains little, a GPU much."""
    from runtime_agent.artifact_dir import load_artifact

    executor = load_artifact(artifact)
    feeds = {1: feed, 16: {n: np.repeat(v, 16, axis=0) for n, v in feed.items()}}
    for batch in feeds:  # warm-up
        executor.run(feeds[batch])
    per_image: dict[int, list[float]] = {1: [], 16: []}
    for _ in range(rounds):
        for batch, calls in ((1, 16), (16, 1)):  # the same images each turn
            start = time.perf_counter()
            for _ in range(calls):
                executor.run(feeds[batch])
            per_image[batch].append((time.perf_counter() - start) / 16)
    rate = {b: [1 / t for t in times] for b, times in per_image.items()}
    print(f"\nthe engine alone, in process ({rounds} interleaved rounds of 16 images; "
          f"load {os.getloadavg()[0]:.2f}): inferences/s median [min–max]")
    for batch, values in rate.items():
        print(f"  batch {batch:2d}: {_spread(values, 1)}")
    print(f"  ceiling of batching: batch 16 / batch 1 = "
          f"{statistics.median(rate[16]) / statistics.median(rate[1]):.2f}")


def dynamic_batch(path: Path) -> bytes:
    """The exported model (batch 1) with a dynamic batch axis: the first dimension of every
    input and output named ``N``, and each Reshape to a constant shape that starts with 1
    (ResNet-50's flatten before its classifier, ``[1, 2048]``) made ``-1``. The exporter
    traces one batch size; the graph's other operators take any."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    for value in (*model.graph.input, *model.graph.output):
        dim = value.type.tensor_type.shape.dim[0]
        dim.ClearField("dim_value")
        dim.dim_param = "N"
    del model.graph.value_info[:]
    initializers = {tensor.name: tensor for tensor in model.graph.initializer}
    for node in model.graph.node:
        target = initializers.get(node.input[1]) if node.op_type == "Reshape" else None
        if target is not None:
            shape = numpy_helper.to_array(target).copy()
            if shape.size and shape[0] == 1:
                shape[0] = -1
                target.CopyFrom(numpy_helper.from_array(shape, target.name))
    return model.SerializeToString()


def main(args: argparse.Namespace) -> None:
    from kiln.architectures import exported

    work = Path(tempfile.mkdtemp(prefix="kiln-batching-"))
    if args.mlp:
        from kiln.examples import mlp

        blob = mlp().SerializeToString()
        feed = {"x": np.ones((1, 64), np.float32)}
        artifact = cached_compile(blob, CompileOptions(tune="off", benchmark_iterations=3),
                                  args.cache, work / "mlp")
    else:
        resnet = exported("resnet50", args.cache or work / "exports")
        blob = dynamic_batch(resnet.path)
        artifact = cached_compile(blob, CompileOptions(tune="off", benchmark_iterations=3),
                                  args.cache, work / "resnet50")
        feed = {name: value[:1] for name, value in dict(resnet.architecture.inputs).items()}
    # ``plain`` reports max_batch_size 0: perf_analyzer sends the whole shape; ``batched``
    # leaves the batch axis out.
    shapes = {"plain": " ".join(f"{n}:{','.join(map(str, v.shape))}" for n, v in feed.items()),
              "batched": " ".join(f"{n}:{','.join(map(str, v.shape[1:]))}"
                                  for n, v in feed.items())}
    http_port, grpc_port = free_port(), free_port()
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(artifact), str(http_port), str(grpc_port),
         str(args.delay_us), str(args.instances)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        if server.stdout.readline().strip() != "ready":
            raise SystemExit("the agent's servers did not start")
        print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
        print(f"engine {artifact.name}; batched: max batch 16, queue delay {args.delay_us} µs,"
              f" {args.instances} instance(s); {args.rounds} round(s) of {args.window_ms} ms "
              f"windows, median [min–max]")
        results: dict[tuple[str, str, int], list[dict[str, float]]] = {}
        for _ in range(args.rounds):
            for protocol in ("http", "grpc"):
                port = http_port if protocol == "http" else grpc_port
                for concurrency in CONCURRENCY:
                    for model in ("plain", "batched"):
                        results.setdefault((protocol, model, concurrency), []).append(
                            perf_analyzer(model, port, protocol, concurrency,
                                          shapes[model], args.window_ms, args.stability,
                                          work))
        print(f"\n{'proto':5s} {'model':8s} {'conc':>4s} {'infer/s':>26s} {'p50 ms':>24s} "
              f"{'p99 ms':>24s}")
        for (protocol, model, concurrency), runs in results.items():
            print(f"{protocol:5s} {model:8s} {concurrency:4d} "
                  f"{_spread([r['throughput'] for r in runs], 1):>26s} "
                  f"{_spread([r['p50'] for r in runs], 2):>24s} "
                  f"{_spread([r['p99'] for r in runs], 2):>24s}")
        for protocol in ("http", "grpc"):
            plain = statistics.median(r["throughput"] for r in results[(protocol, "plain", 16)])
            batched = statistics.median(r["throughput"]
                                        for r in results[(protocol, "batched", 16)])
            lone = (statistics.median(r["p50"] for r in results[(protocol, "batched", 1)]) /
                    statistics.median(r["p50"] for r in results[(protocol, "plain", 1)]))
            print(f"{protocol}: throughput at 16 clients, batched / plain = "
                  f"{batched / plain:.2f}; p50 of a lone client, batched / plain = {lone:.3f}")
        # The agent's own statistics (Triton's route): rows per engine call, per model.
        import json
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/models/stats") as reply:
            for entry in json.load(reply)["model_stats"]:
                executions = max(entry["execution_count"], 1)
                print(f"{entry['name']}: {entry['inference_count']} inferences in "
                      f"{entry['execution_count']} engine calls (mean batch "
                      f"{entry['inference_count'] / executions:.2f})")
    finally:
        if server.stdin:
            server.stdin.close()
        server.wait(30)
    lone_client_overhead(artifact, feed, args.calls)
    engine_ceiling(artifact, feed, rounds=5)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]),
              int(sys.argv[6]))
        sys.exit(0)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mlp", action="store_true", help="the small MLP (a smoke run)")
    parser.add_argument("--delay-us", type=int, default=0)
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window-ms", type=int, default=3000)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--stability", type=int, default=25,
                        help="perf_analyzer's --stability-percentage (raise it on a busy host)")
    parser.add_argument("--cache", type=Path, default=None,
                        help="keep exports and engines here between runs")
    main(parser.parse_args())

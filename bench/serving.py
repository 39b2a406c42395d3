"""Serving overhead over the Open Inference Protocol, beside the bare peer, in one run.

One engine (an MLP 1024→1024→1024, ``kiln.examples.mlp``, batch 1, compiled by Kiln's
pipeline in this process) measured five ways: a bare onnxruntime session on the engine file,
``kiln.runtime.load().run()``, and through an agent inference server (REST and gRPC, in a
child process, as a deployment runs it) with unmodified tritonclient: HTTP with JSON tensors,
HTTP with the binary-tensor extension, and gRPC. Median [min–max] per request; ratios and
differences against the bare session's median.

    .venv/bin/python bench/serving.py [--requests 300]

(tritonclient's gRPC messages and the server's share protobuf names, so the server runs in
its own process: ``bench/serving.py --serve DIR HTTP_PORT GRPC_PORT``.)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import console, fmt, free_port, timed
from rich.table import Table

from kiln.examples import mlp
from schemas import CompileOptions

WIDTH = 1024


def serve(artifact: str, http_port: int, grpc_port: int) -> None:
    """The agent's two servers over one model, until stdin closes."""
    from runtime_agent.artifact_dir import load_artifact
    from runtime_agent.grpc_server import GrpcServer
    from runtime_agent.server import ServerThread, create_app
    from runtime_agent.serving import ModelTable, ServedModel

    models = ModelTable()
    models.put(ServedModel("mlp", load_artifact(Path(artifact))))
    app = create_app(models)
    http = ServerThread(app, "127.0.0.1", http_port)
    http.start()
    grpc = GrpcServer(models, app.state.metrics, "127.0.0.1", grpc_port, workers=4)
    grpc.start()
    print("ready", flush=True)
    sys.stdin.read()
    grpc.stop()
    http.stop()


def main(requests: int) -> None:
    import onnxruntime as ort
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    from compiler_worker.pipeline import compile_model, write_artifact_dir
    from kiln import runtime
    from runtime_agent.fingerprint import detect_fingerprint

    feed = {"x": np.random.default_rng(0).normal(size=(1, WIDTH)).astype(np.float32)}
    model = mlp(in_features=WIDTH, hidden=WIDTH, out_features=WIDTH).SerializeToString()
    with tempfile.TemporaryDirectory() as tmp:
        result = compile_model(model, CompileOptions(benchmark_iterations=5),
                               fingerprint=detect_fingerprint(), workdir=Path(tmp) / "w")
        artifact = write_artifact_dir(result, Path(tmp) / "mlp")
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        session = ort.InferenceSession(str(next(artifact.glob("engine*"))), options,
                                       providers=["CPUExecutionProvider"])
        loaded = runtime.load(artifact)
        http_port, grpc_port = free_port(), free_port()
        server = subprocess.Popen(
            [sys.executable, __file__, "--serve", str(artifact), str(http_port),
             str(grpc_port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None and server.stdout.readline().strip() == "ready"
            http = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")
            grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")

            def http_call(binary: bool) -> None:
                tensor = httpclient.InferInput("x", [1, WIDTH], "FP32")
                tensor.set_data_from_numpy(feed["x"], binary_data=binary)
                out = httpclient.InferRequestedOutput("y", binary_data=binary)
                http.infer("mlp", [tensor], outputs=[out]).as_numpy("y")

            def grpc_call() -> None:
                tensor = grpcclient.InferInput("x", [1, WIDTH], "FP32")
                tensor.set_data_from_numpy(feed["x"])
                grpc.infer("mlp", [tensor]).as_numpy("y")

            want = session.run(None, feed)[0]
            tensor = grpcclient.InferInput("x", [1, WIDTH], "FP32")
            tensor.set_data_from_numpy(feed["x"])
            np.testing.assert_allclose(grpc.infer("mlp", [tensor]).as_numpy("y"), want,
                                       rtol=1e-5, atol=1e-5)
            paths = {
                "bare onnxruntime session": lambda: session.run(None, feed),
                "kiln.runtime.load().run()": lambda: loaded.run(feed),
                "HTTP JSON (tritonclient)": lambda: http_call(False),
                "HTTP binary (tritonclient)": lambda: http_call(True),
                "gRPC (tritonclient)": grpc_call,
            }
            samples = {name: timed(fn, requests, warmup=20) for name, fn in paths.items()}
        finally:
            if server.stdin:
                server.stdin.close()
            server.wait(30)
    base = float(np.median(samples["bare onnxruntime session"]))
    table = Table(title=f"MLP {WIDTH}→{WIDTH}→{WIDTH}, batch 1: {requests} requests per path, "
                        "median \\[min–max]; ratio and added time against the bare session")
    for col in ("path", "latency", "ratio", "added (median)"):
        table.add_column(col)
    for name, values in samples.items():
        median = float(np.median(values))
        table.add_row(name, fmt(values, 1e6, "µs", 1), f"{median / base:.2f}×",
                      f"{(median - base) * 1e6:+.1f} µs")
    console.print(table)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--serve":
        serve(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        sys.exit(0)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    started = time.perf_counter()
    main(parser.parse_args().requests)
    console.print(f"total {time.perf_counter() - started:.0f} s")

"""Serving overhead in-process and over the Open Inference Protocol, beside the bare peer, in one
run.

Engines, compiled by Kiln's pipeline in this process (``compile_model``):

- an MLP 1024→1024→1024 (``kiln.examples.mlp``), batch 1;
- ResNet-50 (``kiln.architectures.resnet50``: transformers' model with random weights, exported
  by ``torch.onnx.export`` with its defaults, as ``bench/engines.py`` builds it), batch 1,
  ``tune="off"`` (the backend's default configuration) to keep the build short.

Latency tables (median \\[p10–p90] per call; ratio and added time of the medians against the
peer named in the row, measured in the same run, and the added time paired by round: each
round's block median minus the peer's of the same round, median \\[min–max] over the rounds —
on a shared machine the load moves between rounds, and pairing compares blocks timed close
together):

- the bare onnxruntime session on the engine file, with the engine's own session settings
  (``runtime_config``: optimization level, thread counts, execution mode) — the same thread
  settings as Kiln's session;
- ``kiln.runtime.load().run()`` (host inputs: the session's native run, outputs from
  onnxruntime's allocator), and with ``out=`` (the caller's buffers, bound through an
  IOBinding); both against the bare session;
- ``kiln.torch.load()`` eager and inside ``torch.compile(fullgraph=True)``, on torch tensors,
  against ``kiln.runtime``; on the 8-wide engine also the compiled row against the eager one,
  beside ``torch.compile`` of ``x + 1`` against eager ``x + 1`` (what torch.compile's guards and
  wrappers cost any compiled function), of ``x + 1`` through the ``eager`` backend (TorchDynamo's
  frame evaluation and guards alone, with no compiler behind them), and of a custom op whose
  Python kernel only copies its input, defined as ``kiln.torch`` defines an engine's, against
  the same op eager (what they cost a graph that calls a Python custom op: the floor under the
  compiled row);
- an agent inference server (REST and gRPC, in a child process, as a deployment runs it)
  through unmodified tritonclient: HTTP JSON (MLP only), HTTP binary, gRPC, against
  ``kiln.runtime``; and the gRPC floor beside them: a bare ``GRPCInferenceService`` servicer in
  the same process and the same kind of grpcio server, running the same onnxruntime session
  with no checks, metrics or token. The row "gRPC, against the floor" is what Kiln's handler
  adds; the floor's own distance from ``kiln.runtime`` is tritonclient, grpcio on both sides
  and the engine answering in a server process (where its weights have left the caches
  between requests). Under it, the transport alone: the same servicer answering a response
  built once, running nothing (MLP only).

The in-process paths run in alternating blocks (``--block`` calls each, the order reversed every
round) rather than call by call: onnxruntime's intra-op threads spin for a while after each run,
and with several sessions in one process a session called right after another competes with the
other's spinning threads — calling two sessions in strict alternation measures that contention,
not the code path (on a 2-core machine it doubled the bare session's time). The first calls of
each block are not timed for the same reason.

Transport of a 224×224 image: ResNet-50's input through HTTP binary and gRPC to an engine that
does no work (it slices 1000 values of the image), against ``kiln.runtime`` on it: the
protocols' cost for the image apart from the engine, whose time in a server process on a
loaded machine moves by more than the transports cost.

Throughput (ResNet-50): 8 concurrent clients, in-process (8 threads on one ``kiln.runtime``
engine) and against the agent's gRPC (and the gRPC floor's) and HTTP-binary servers (8
tritonclient clients, one per thread); the engine has the same thread settings in both
processes and the client process only waits on sockets. ``--seconds`` per path, split into
``--throughput-rounds`` alternating blocks (the order reversed every round): requests per second,
and their ratio to in-process, of the medians and per block against the in-process block of the
same round.

    .venv/bin/python bench/serving.py [--rounds 8 --block 100 --seconds 12 --throughput-rounds 4
                                       --cache DIR]
    .venv/bin/python bench/serving.py --mlp-only

(tritonclient's gRPC messages and the server's share protobuf names, so the server runs in
its own process: ``bench/serving.py --serve DIR HTTP_PORT GRPC_PORT``.)
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from _common import blocks, console, free_port
from rich.table import Table

from kiln.examples import mlp
from schemas.options import CompileOptions

WIDTH = 1024
CLIENTS = 8
FLOOR = "gRPC floor: bare servicer, same session (tritonclient)"
#: The transport alone: a servicer that answers a response built once, running nothing.
ECHO = "gRPC transport: servicer answering a kept response (tritonclient)"
#: TorchDynamo alone: ``x + 1`` captured and run by the ``eager`` backend (no compiler).
DYNAMO_ONLY = 'torch.compile(x + 1, backend="eager")'
IN_PROCESS = "in-process (kiln.runtime, 8 threads)"
GRPC_OVER_FLOOR = "gRPC (tritonclient), against the floor"
COPY_OP = "custom op copying x (Python kernel), eager"
COPY_OP_COMPILED = "custom op copying x, in torch.compile(fullgraph)"
#: torch.compile's own share of the compiled row, beside what it adds to ``x + 1``.
COMPILE_OVER_EAGER = "kiln.torch in torch.compile, against kiln.torch eager"


def serve(artifact: str, http_port: int, grpc_port: int) -> None:
    """The agent's two servers over one model, until stdin closes."""
    from runtime_agent.artifact_dir import load_artifact
    from runtime_agent.grpc_server import GrpcServer
    from runtime_agent.server import ServerThread, create_app
    from runtime_agent.serving import ModelTable, ServedModel

    models = ModelTable()
    models.put(ServedModel("m", load_artifact(Path(artifact))))
    app = create_app(models)
    http = ServerThread(app, "127.0.0.1", http_port)
    http.start()
    grpc = GrpcServer(models, app.state.metrics, "127.0.0.1", grpc_port, workers=CLIENTS)
    grpc.start()
    floor = _floor_server(models.get("m"), CLIENTS)
    echo = _floor_server(models.get("m"), CLIENTS, echo=True)
    print(f"ready {floor.port} {echo.port}", flush=True)
    sys.stdin.read()
    echo.stop(None)  # type: ignore[attr-defined]
    floor.stop(None)  # type: ignore[attr-defined]
    grpc.stop()
    http.stop()


def _floor_server(model: object, workers: int, *, echo: bool = False) -> object:
    """The floor of the gRPC row: a bare ``GRPCInferenceService`` from the same generated code
    in the same kind of server (grpcio's thread pool), whose ``ModelInfer`` runs the engine's
    onnxruntime session on the raw input and answers its raw output, and nothing else: no
    checks, no metrics, no token. What tritonclient, grpcio and the engine cost together; the
    agent's gRPC row minus this one is what Kiln's handler adds.

    ``echo``: the servicer answers a response built once at start (the engine's output for
    zeros) and runs nothing: what tritonclient and grpcio cost a request of this size on
    their own, the floor under every gRPC row."""
    from concurrent import futures

    import grpc

    from runtime_agent.protocol import grpc_predict_v2_pb2 as pb
    from runtime_agent.protocol import grpc_predict_v2_pb2_grpc as pb_grpc

    session = model.executor.session  # type: ignore[attr-defined]
    spec = model.manifest.inputs[0]  # type: ignore[attr-defined]
    output = model.manifest.outputs[0].name  # type: ignore[attr-defined]

    def answer(y: np.ndarray, request: object | None = None) -> object:
        response = pb.ModelInferResponse(model_name=getattr(request, "model_name", "m"),
                                         id=getattr(request, "id", ""))
        response.outputs.add(name=output, datatype="FP32", shape=list(y.shape))
        response.raw_output_contents.append(y.tobytes())
        return response

    kept = answer(session.run(None, {spec.name: np.zeros(
        [1 if isinstance(d, str) else d for d in spec.shape], np.float32)})[0]) if echo else None

    class Floor(pb_grpc.GRPCInferenceServiceServicer):
        def ModelInfer(self, request, context):
            if kept is not None:
                return kept
            x = np.frombuffer(request.raw_input_contents[0], np.float32).reshape(
                tuple(request.inputs[0].shape))
            return answer(session.run(None, {spec.name: x})[0], request)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(Floor(), server)
    server.port = server.add_insecure_port("127.0.0.1:0")  # type: ignore[attr-defined]
    server.start()
    return server


class Server:
    """``serve()`` in a child process, and tritonclient calls against it."""

    def __init__(self, artifact: Path, inputs: dict[str, np.ndarray], output: str) -> None:
        self.http_port, self.grpc_port = free_port(), free_port()
        self.inputs, self.output = inputs, output
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", str(artifact), str(self.http_port),
             str(self.grpc_port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        ready, floor_port, echo_port = self.proc.stdout.readline().split()
        assert ready == "ready"
        self.floor_port, self.echo_port = int(floor_port), int(echo_port)

    def http_call(self, binary: bool) -> Callable[[], np.ndarray]:
        import tritonclient.http as httpclient

        client = httpclient.InferenceServerClient(f"127.0.0.1:{self.http_port}")

        def call() -> np.ndarray:
            tensors = []
            for name, value in self.inputs.items():
                tensor = httpclient.InferInput(name, list(value.shape), "FP32")
                tensor.set_data_from_numpy(value, binary_data=binary)
                tensors.append(tensor)
            out = httpclient.InferRequestedOutput(self.output, binary_data=binary)
            return client.infer("m", tensors, outputs=[out]).as_numpy(self.output)
        return call

    def grpc_call(self, port: int | None = None) -> Callable[[], np.ndarray]:
        """tritonclient's gRPC infer against the agent's server, or the one on ``port``
        (``floor_port``: the bare servicer; ``echo_port``: the one that runs nothing)."""
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port or self.grpc_port}")

        def call() -> np.ndarray:
            tensors = []
            for name, value in self.inputs.items():
                tensor = grpcclient.InferInput(name, list(value.shape), "FP32")
                tensor.set_data_from_numpy(value)
                tensors.append(tensor)
            return client.infer("m", tensors).as_numpy(self.output)
        return call

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(30)


def throughput(make_call: Callable[[], Callable[[], object]], seconds: float) -> float:
    """Requests per second of ``CLIENTS`` threads, each calling its own ``make_call()`` (made
    in its thread: tritonclient's HTTP client belongs to the thread that made it)."""
    counts = [0] * CLIENTS
    stop = threading.Event()
    start = threading.Barrier(CLIENTS + 1)
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            call = make_call()
            call()
        except BaseException as exc:
            errors.append(exc)
            start.abort()
            raise
        start.wait()
        while not stop.is_set():
            call()
            counts[i] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return sum(counts) / (time.perf_counter() - began)


def bare_session(artifact: Path) -> object:
    """An onnxruntime session on the engine file with the engine's own session settings."""
    import onnxruntime as ort

    from runtime_agent.artifact_dir import read_manifest
    from runtime_agent.executors.onnxruntime.executor import session_options

    config = read_manifest(artifact).runtime_config
    return ort.InferenceSession(str(next(artifact.glob("engine*"))), session_options(config),
                                providers=list(config.get("providers",
                                                          ["CPUExecutionProvider"])))


def in_process_paths(artifact: Path, feed: dict[str, np.ndarray], output: str,
                     ) -> tuple[dict[str, Callable[[], object]], dict[str, str]]:
    """The in-process paths on one engine, and the peer each row is compared with."""
    import torch

    import kiln.torch
    from kiln import runtime

    session = bare_session(artifact)
    loaded = runtime.load(artifact)
    want = session.run(None, feed)[0]
    np.testing.assert_allclose(loaded.run(feed)[output], want, rtol=1e-5, atol=1e-5)
    out = {output: np.empty_like(want)}
    module = kiln.torch.load(artifact)
    tensors = [torch.from_numpy(value) for value in feed.values()]
    compiled = torch.compile(lambda *xs: module(*xs), fullgraph=True)
    with torch.inference_mode():
        np.testing.assert_allclose(compiled(*tensors).numpy(), want, rtol=1e-5, atol=1e-5)

    def in_inference_mode(fn: Callable[..., object]) -> Callable[[], object]:
        def call() -> object:
            with torch.inference_mode():
                return fn(*tensors)
        return call

    paths = {
        "bare onnxruntime session": lambda: session.run(None, feed),
        "kiln.runtime run()": lambda: loaded.run(feed),
        "kiln.runtime run(out=) (IOBinding)": lambda: loaded.run(feed, out=out),
        "kiln.torch module, eager": in_inference_mode(module),
        "kiln.torch in torch.compile(fullgraph)": in_inference_mode(compiled),
    }
    peers = {"kiln.runtime run()": "bare onnxruntime session",
             "kiln.runtime run(out=) (IOBinding)": "bare onnxruntime session",
             "kiln.torch module, eager": "kiln.runtime run()",
             "kiln.torch in torch.compile(fullgraph)": "kiln.runtime run()"}
    return paths, peers


def compile_floor(x: np.ndarray) -> dict[str, Callable[[], object]]:
    """``x + 1``, and a custom op whose Python kernel only copies its input (defined as
    ``kiln.torch`` defines an engine's: a ``torch.library`` fragment, a CPU kernel, a fake),
    each eager and under ``torch.compile(fullgraph=True)``, in inference mode: what
    torch.compile costs per call whatever the graph calls, and what it costs a graph that
    calls a Python custom op."""
    import torch

    tensor = torch.from_numpy(x)
    library = torch.library.Library("kiln_bench", "FRAGMENT")
    library.define("copy(Tensor i0) -> Tensor")
    library.impl("copy", lambda t: torch.from_numpy(t.numpy().copy()), "CPU")
    torch.library.register_fake("kiln_bench::copy", lambda t: t.new_empty(t.shape),
                                lib=library)
    _LIBRARIES.append(library)
    op = torch.ops.kiln_bench.copy.default
    compiled = torch.compile(lambda t: t + 1, fullgraph=True)
    dynamo_only = torch.compile(lambda t: t + 1, fullgraph=True, backend="eager")
    compiled_op = torch.compile(lambda t: op(t), fullgraph=True)

    def under(fn: Callable[..., object]) -> Callable[[], object]:
        def call() -> object:
            with torch.inference_mode():
                return fn(tensor)
        return call

    under(compiled)()
    under(dynamo_only)()
    under(compiled_op)()
    return {"eager x + 1": under(lambda t: t + 1), "torch.compile(x + 1)": under(compiled),
            DYNAMO_ONLY: under(dynamo_only),
            COPY_OP: under(op), COPY_OP_COMPILED: under(compiled_op)}


#: Keeps the benchmark's op library alive (its ops live as long as it).
_LIBRARIES: list[object] = []


def spread(values: list[float], unit: float, suffix: str) -> str:
    """median \\[10th–90th percentile]: on a shared machine the extremes are preemptions."""
    p10, p50, p90 = np.percentile(values, [10, 50, 90]) * unit
    return f"{p50:.1f} {suffix} \\[{p10:.1f}–{p90:.1f}]"


def latency_table(title: str, samples: dict[str, list[float]], peers: dict[str, str],
                  unit: float, suffix: str, block: int) -> None:
    """One row per path: its latency, and against its peer the ratio and added time of the
    medians, and the added time paired by round (each round's block median minus the peer's
    block median of the same round: on a shared machine whose load moves between rounds, the
    figure that compares like with like), median \\[min–max] over the rounds."""
    table = Table(title=title)
    for col in ("path", "latency", "compared with", "ratio", "added (medians)",
                "added, paired by round"):
        table.add_column(col)
    for name, values in samples.items():
        median = statistics.median(values)
        peer = peers.get(name)
        if peer is None:
            table.add_row(name, spread(values, unit, suffix), "—", "", "", "")
            continue
        base = statistics.median(samples[peer])
        paired = [(a - b) * unit for a, b in zip(_block_medians(values, block),
                                                  _block_medians(samples[peer], block),
                                                  strict=True)]
        table.add_row(name, spread(values, unit, suffix), peer, f"{median / base:.3f}×",
                      f"{(median - base) * unit:+.1f} {suffix}",
                      f"{statistics.median(paired):+.1f} \\[{min(paired):+.1f}–"
                      f"{max(paired):+.1f}] {suffix}")
    console.print(table)


def _block_medians(values: list[float], block: int) -> list[float]:
    return [statistics.median(values[i:i + block]) for i in range(0, len(values), block)]


def compile_dir(model: bytes, options: CompileOptions, out: Path) -> Path:
    from compiler_worker.pipeline import compile_model, write_artifact_dir
    from runtime_agent.fingerprint import detect_fingerprint

    result = compile_model(model, options, fingerprint=detect_fingerprint(),
                           workdir=out.with_name(out.name + "-work"))
    return write_artifact_dir(result, out)


def cached_compile(model: bytes, options: CompileOptions, cache: Path | None,
                   out: Path) -> Path:
    """``compile_dir``, kept in ``cache`` under its artifact id (the digest of the model, the
    options, this machine's fingerprint key and the toolchain) when a cache is given."""
    if cache is None:
        return compile_dir(model, options, out)
    import hashlib

    from compiler_worker.pipeline import plan_build
    from runtime_agent.fingerprint import detect_fingerprint

    plan = plan_build(hashlib.sha256(model).hexdigest(), options, detect_fingerprint())
    artifact = cache / f"engine-{plan.artifact_id}"
    if not (artifact / "manifest.json").is_file():
        compile_dir(model, options, artifact)
    return artifact


def slice_model(image: dict[str, np.ndarray], output: str, classes: int = 1000) -> bytes:
    """An engine with ResNet-50's input and output that does no work: the first ``classes``
    values of the image."""
    from onnx import TensorProto, helper

    (name, value), = image.items()
    ints = [helper.make_tensor(n, TensorProto.INT64, [1], [v])
            for n, v in (("starts", 0), ("ends", classes), ("axes", 1))]
    graph = helper.make_graph(
        [helper.make_node("Flatten", [name], ["flat"], axis=1),
         helper.make_node("Slice", ["flat", "starts", "ends", "axes"], [output])],
        "image_slice", [helper.make_tensor_value_info(name, TensorProto.FLOAT, list(value.shape))],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, [value.shape[0], classes])],
        ints)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]
                             ).SerializeToString()


def image_transport(image: dict[str, np.ndarray], output: str, args: argparse.Namespace,
                    out: Path) -> None:
    """ResNet-50's image through each transport to an engine that does no work: what the
    protocols cost a 224×224 image, apart from the engine's time (which, in a server
    process on a loaded machine, moves by more than the transports cost)."""
    artifact = compile_dir(slice_model(image, output), CompileOptions(benchmark_iterations=3),
                           out)
    from kiln import runtime

    loaded = runtime.load(artifact)
    server = Server(artifact, image, output)
    try:
        paths = {"kiln.runtime run()": lambda: loaded.run(image),
                 "HTTP binary (tritonclient)": server.http_call(True),
                 "gRPC (tritonclient)": server.grpc_call(),
                 FLOOR: server.grpc_call(server.floor_port)}
        samples = blocks(paths, args.rounds, args.block)
    finally:
        server.close()
    peers = {name: "kiln.runtime run()" for name in paths if name != "kiln.runtime run()"}
    latency_table(f"a 1×3×224×224 image to an engine that does no work (slices 1000 values): "
                  f"{args.rounds} blocks of {args.block} calls, median \\[p10–p90]",
                  samples, peers, 1e3, "ms", args.block)


def main(args: argparse.Namespace) -> None:
    from kiln.architectures import exported
    from kiln.model_files import model_blob

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        # ---------------------------------------------------------------- MLP
        feed = {"x": np.random.default_rng(0).normal(size=(1, WIDTH)).astype(np.float32)}
        model = mlp(in_features=WIDTH, hidden=WIDTH, out_features=WIDTH).SerializeToString()
        artifact = compile_dir(model, CompileOptions(benchmark_iterations=5), work / "mlp")
        paths, peers = in_process_paths(artifact, feed, "y")
        server = Server(artifact, feed, "y")
        try:
            remote = {"HTTP JSON (tritonclient)": server.http_call(False),
                      "HTTP binary (tritonclient)": server.http_call(True),
                      "gRPC (tritonclient)": server.grpc_call(),
                      FLOOR: server.grpc_call(server.floor_port),
                      ECHO: server.grpc_call(server.echo_port)}
            for name in ("gRPC (tritonclient)", FLOOR):
                np.testing.assert_allclose(remote[name](), paths[
                    "bare onnxruntime session"]()[0], rtol=1e-5, atol=1e-5)
            samples = blocks(paths, args.rounds, args.block)
            samples.update(blocks(remote, args.rounds, args.block))
        finally:
            server.close()
        peers.update({name: "kiln.runtime run()" for name in remote})
        samples[GRPC_OVER_FLOOR] = samples["gRPC (tritonclient)"]
        peers[GRPC_OVER_FLOOR] = FLOOR
        latency_table(f"MLP {WIDTH}→{WIDTH}→{WIDTH}, batch 1: {args.rounds} blocks of "
                      f"{args.block} calls per in-process path, median \\[p10–p90]",
                      samples, peers, 1e6, "µs", args.block)

        # ------------------------------------------- per-call overhead on a tiny engine
        # On the 1024-wide MLP each call spends ~200 µs in onnxruntime and its spinning
        # intra-op threads, whose interference with the caller moves medians by tens of µs
        # between paths. An 8-wide engine leaves the per-call cost of each layer visible, and
        # torch.compile's own per-call cost on ``x + 1`` (its guards and wrapper, paid by any
        # compiled function) is measured beside it.
        tiny = compile_dir(mlp(in_features=8, hidden=8, out_features=8).SerializeToString(),
                           CompileOptions(benchmark_iterations=5), work / "tiny")
        tiny_feed = {"x": feed["x"][:, :8].copy()}
        tiny_paths, tiny_peers = in_process_paths(tiny, tiny_feed, "y")
        tiny_paths.update(compile_floor(tiny_feed["x"]))
        tiny_peers["torch.compile(x + 1)"] = "eager x + 1"
        tiny_peers[DYNAMO_ONLY] = "eager x + 1"
        tiny_peers[COPY_OP_COMPILED] = COPY_OP
        tiny_samples = blocks(tiny_paths, args.rounds, args.block * 5)
        compiled = "kiln.torch in torch.compile(fullgraph)"
        tiny_samples[COMPILE_OVER_EAGER] = tiny_samples[compiled]
        tiny_peers[COMPILE_OVER_EAGER] = "kiln.torch module, eager"
        latency_table(f"per-call overhead, MLP 8→8→8, batch 1: {args.rounds} blocks of "
                      f"{args.block * 5} calls, median \\[p10–p90]",
                      tiny_samples, tiny_peers, 1e6, "µs", args.block * 5)

        # ---------------------------------------------------------------- ResNet-50
        if args.mlp_only:
            return
        started = time.perf_counter()
        resnet = exported("resnet50", args.cache or work / "exports")
        blob = model_blob(resnet.path, work / "resnet-blob").read_bytes()
        artifact = cached_compile(blob, CompileOptions(tune="off", benchmark_iterations=3),
                                  args.cache, work / "resnet50")
        console.print(f"ResNet-50 exported and compiled (or found in the cache) in "
                      f"{time.perf_counter() - started:.0f} s")
        image = dict(resnet.architecture.inputs)
        output = _first_output(artifact)
        image_transport(image, output, args, work / "image-slice")
        paths, peers = in_process_paths(artifact, image, output)
        server = Server(artifact, image, output)
        try:
            remote = {"HTTP binary (tritonclient)": server.http_call(True),
                      "gRPC (tritonclient)": server.grpc_call(),
                      FLOOR: server.grpc_call(server.floor_port)}
            # Short blocks and many rounds: a call takes tens of milliseconds, and the
            # machine's load moves less between two blocks of a round the shorter they are.
            per_block, rounds = 4, args.rounds * 3
            samples = blocks({**paths, **remote}, rounds, per_block, skip=1)
            peers.update({name: "kiln.runtime run()" for name in remote})
            samples[GRPC_OVER_FLOOR] = samples["gRPC (tritonclient)"]
            peers[GRPC_OVER_FLOOR] = FLOOR
            latency_table(f"ResNet-50, batch 1 (224×224): {rounds} blocks of {per_block} "
                          f"calls per path, median \\[p10–p90]", samples, peers, 1e3, "ms",
                          per_block)
            loaded = paths_engine(artifact)
            block_s = args.seconds / args.throughput_rounds
            rates = throughput_rounds({
                IN_PROCESS: lambda: lambda: loaded.run(image),
                "gRPC (tritonclient, 8 clients)": server.grpc_call,
                "gRPC floor: bare servicer (tritonclient, 8 clients)":
                    lambda: server.grpc_call(server.floor_port),
                "HTTP binary (tritonclient, 8 clients)": lambda: server.http_call(True),
            }, args.throughput_rounds, block_s)
        finally:
            server.close()
        base = rates[IN_PROCESS]
        table = Table(title=f"ResNet-50, batch 1: {CLIENTS} concurrent clients, "
                            f"{args.throughput_rounds} alternating blocks of {block_s:g} s per "
                            f"path")
        for col in ("path", "requests/s, median \\[min–max]", "of in-process (medians)",
                    "of in-process, per block \\[min–max]"):
            table.add_column(col)
        for name, values in rates.items():
            paired = [rate / ref for rate, ref in zip(values, base, strict=True)]
            table.add_row(name, f"{statistics.median(values):.2f} \\[{min(values):.2f}–"
                                f"{max(values):.2f}]",
                          f"{statistics.median(values) / statistics.median(base):.1%}",
                          f"{statistics.median(paired):.1%} \\[{min(paired):.1%}–"
                          f"{max(paired):.1%}]")
        console.print(table)


def throughput_rounds(paths: dict[str, Callable[[], Callable[[], object]]], rounds: int,
                      seconds: float) -> dict[str, list[float]]:
    """``throughput`` of each path, in ``rounds`` alternating blocks of ``seconds`` (the
    order reversed every round): a shared machine's load moves between blocks, and each
    block is compared with the in-process block next to it."""
    rates: dict[str, list[float]] = {name: [] for name in paths}
    order = list(paths)
    for round_ in range(rounds):
        for name in order if round_ % 2 == 0 else order[::-1]:
            rates[name].append(throughput(paths[name], seconds))
    return rates


def paths_engine(artifact: Path) -> object:
    from kiln import runtime

    return runtime.load(artifact)


def _first_output(artifact: Path) -> str:
    from runtime_agent.artifact_dir import read_manifest

    return read_manifest(artifact).outputs[0].name


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--serve":
        serve(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        sys.exit(0)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--block", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=12.0,
                        help="throughput: seconds per path, split over --throughput-rounds")
    parser.add_argument("--throughput-rounds", type=int, default=4)
    parser.add_argument("--mlp-only", action="store_true", help="the MLP table only")
    parser.add_argument("--cache", type=Path, default=None,
                        help="where ResNet-50's export and engine are kept between runs")
    began = time.perf_counter()
    main(parser.parse_args())
    console.print(f"total {time.perf_counter() - began:.0f} s")

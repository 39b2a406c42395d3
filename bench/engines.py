"""Kiln's engine beside the engines a user would otherwise reach for, measured in one run.

Per model, every engine runs in its own process (spawned; each loads its engine once), and the
parent interleaves timing rounds across them — round ``r`` asks each process in turn for
``--iters`` timed calls (more, to fill ``MIN_BLOCK_S``) on the same feed, starting one engine
later each round — so drift on the machine (other load, thermal state) hits every engine
alike. Engines:

- ``pytorch eager``: the transformers / torch module itself under ``torch.inference_mode``;
- ``ort L0``..``ort L3``: a plain ``onnxruntime.InferenceSession`` on the exported model at
  ``ORT_DISABLE_ALL`` / ``BASIC`` / ``EXTENDED`` / ``ALL``, fp32;
- ``ort int8 dynamic``: ``quantize_dynamic`` by hand (its defaults);
- ``ort int8 static QDQ``: ``quantize_static`` in QDQ format with per-channel weights,
  calibrated on the samples by a ``CalibrationDataReader``;
- ``ov fp32`` / ``ov bf16``: OpenVINO by hand: ``openvino.convert_model`` on the exported
  ONNX model, compiled for ``CPU`` under the ``LATENCY`` hint with ``INFERENCE_PRECISION_HINT``
  ``f32`` / ``bf16`` (bf16 only where the CPU has AMX-BF16 or AVX-512 BF16);
- ``ov int8 NNCF``: ``nncf.quantize`` (post-training, the transformer preset for models with
  attention) on the samples, compiled with the plugin's defaults, as a user would;
- ``torch.compile``: the same module under ``torch.compile`` (Inductor, default mode); its
  cold compile time (the first call) is its prepare time;
- ``kiln fp32`` / ``kiln auto``: ``compile_model`` with ``tune="auto"`` and that precision
  policy, given the samples (the dataset the tuner verifies, gates and calibrates on), loaded
  from its artifact directory with ``runtime_agent.executors.load_executor``;
- ``kiln iree``: ``compile_model`` with ``backends=["iree"]`` (candidates default, data
  tiling, micro-kernels, channels-last convolutions, for this CPU's ISA class), fp32;
- ``kiln aotinductor``: the module exported with ``torch.export`` (``.pt2``) and compiled by
  ``compile_model`` for the AOTInductor backend (candidates ``default`` and ``freezing``,
  verified against the eager program on the same samples), loaded the same way. Its prepare
  time is the cold build (every candidate, verification, benchmark).

Below each table: the faster of the two verified Kiln fp32 engines (onnxruntime from the ONNX
export, AOTInductor from the torch.export program). Kiln's tuner chooses among one backend's
candidates per fingerprint key; this line is the cross-backend choice measured here.

Every engine's accuracy is measured against fp32 onnxruntime with optimizations off (the
reference Kiln verifies against) on the same samples: top-1 agreement for classifiers (64
images for ResNet-50), mean cosine of the output for the encoder and the MLP. The gate is
top-1 agreement >= 99% for classifiers (``--top1`` sets the share), cosine >= 0.99 otherwise
(the worst sample's), and Kiln's builds are given the same gate as their request's
``accuracy``; "vs best gated peer" divides each engine's median by
the fastest peer (every engine but Kiln's) that passes it, so a Kiln row at 1.05 or below is
within 5% of what a user reaches by hand at the same accuracy. The samples are
inputs generated to fit each graph (``compiler_worker.inputs``); the timed feed is the
model's example input. Models are built with random weights (``kiln.architectures``) and
exported by ``torch.onnx.export`` with its defaults; exports are cached under ``--cache``.
Thread counts are each runtime's default unless ``--threads`` sets them for the peers (Kiln's
engine uses the configuration its tuner chose).

    .venv/bin/python bench/engines.py                     # all models, full size
    .venv/bin/python bench/engines.py --quick             # small configs: a smoke run
    .venv/bin/python bench/engines.py --models resnet50-b1,bert-base --rounds 10 --iters 20
    .venv/bin/python bench/engines.py --models resnet50-b1,bert-base --fp32-only  # no int8
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import io
import logging
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger("bench.engines")

ORT_LEVELS = {0: "ORT_DISABLE_ALL", 1: "ORT_ENABLE_BASIC", 2: "ORT_ENABLE_EXTENDED",
              3: "ORT_ENABLE_ALL"}


@dataclass(frozen=True)
class Case:
    """One benchmarked model configuration."""

    architecture: str
    batch: int = 1
    seq: int = 128
    #: Feeds for accuracy, calibration and Kiln's samples dataset.
    samples: int = 16


#: Seconds between two engines' timed blocks (see ``run_case``).
IDLE_GAP_S = 0.2
#: The shortest timed block: the host's load is read from ``/proc/stat`` in clock ticks, and
#: over a block of a few milliseconds (an MLP's 50 calls) one tick of skew between the host's
#: count and this process's own reads as another process taking the whole CPU. A fast engine
#: gets more calls per block instead.
MIN_BLOCK_S = 0.25
#: Times a block is taken again when another process took more of the CPU than the tuner's
#: threshold while it ran (a periodic job on the host, say): its figures are dropped.
RETAKES = 3

CASES = {
    "resnet50-b1": Case("resnet50", batch=1, samples=64),
    "resnet50-b8": Case("resnet50", batch=8, samples=8),  # 8 feeds of 8: 64 images
    "bert-base": Case("bert_base", batch=1, seq=128, samples=16),
    "mlp": Case("mlp", batch=1, samples=16),
}


@dataclass
class Engine:
    """One row: what to load in a worker process, and what was measured."""

    name: str
    group: str  # "fp32 peer", "reduced peer" (int8, bf16) or "kiln"
    spec: dict[str, Any] | None
    precision: str = "fp32"
    #: Seconds spent preparing it (quantizing by hand, Kiln's build), if any.
    prepare_s: float | None = None
    note: str = ""
    times: list[float] = field(default_factory=list)
    accuracy: str = "—"
    #: Whether the accuracy meets the gate (``_accuracy``).
    gated: bool = False
    threads: str = "default"
    error: str = ""


# --------------------------------------------------------------------------- worker process

def _load(spec: dict[str, Any]) -> tuple[Any, str]:
    """(callable feed -> first output as numpy, thread description) for an engine spec."""
    kind = spec["kind"]
    threads = spec.get("threads")
    if kind == "torch":
        import torch

        from kiln.architectures import build

        if threads:
            torch.set_num_threads(threads)
        kwargs = {"size": spec["size"], "batch": spec["batch"], "seed": spec["seed"]}
        if "seq" in spec:
            kwargs["seq"] = spec["seq"]
        architecture = build(spec["architecture"], **kwargs)
        module = architecture.module
        if spec.get("compile"):
            module = torch.compile(module)

        def run(feed: dict[str, np.ndarray]) -> np.ndarray:
            with torch.inference_mode():
                return module(*architecture.torch_inputs(feed)).numpy()

        return run, f"torch {torch.get_num_threads()}"
    if kind == "ort":
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.graph_optimization_level = getattr(ort.GraphOptimizationLevel,
                                                   ORT_LEVELS[spec["level"]])
        options.log_severity_level = 3
        if threads:
            options.intra_op_num_threads = threads
        session = ort.InferenceSession(spec["path"], options, providers=["CPUExecutionProvider"])
        first = session.get_outputs()[0].name

        def run(feed: dict[str, np.ndarray]) -> np.ndarray:
            return session.run([first], feed)[0]

        return run, f"intra-op {threads}" if threads else "ort default"
    if kind == "ov":
        import openvino as ov

        core = ov.Core()
        properties: dict[str, str] = {"PERFORMANCE_HINT": "LATENCY"}
        if spec.get("precision"):
            properties["INFERENCE_PRECISION_HINT"] = spec["precision"]
        if threads:
            properties["INFERENCE_NUM_THREADS"] = str(threads)
        compiled = core.compile_model(core.read_model(spec["path"]), "CPU", properties)
        request = compiled.create_infer_request()
        names = [port.get_any_name() for port in compiled.inputs]

        def run(feed: dict[str, np.ndarray]) -> np.ndarray:
            return np.array(request.infer([feed[name] for name in names])[0])

        return run, f"inference threads {threads}" if threads else "openvino default"
    if kind == "kiln":
        from runtime_agent.executors import load_executor
        from schemas.manifest import ArtifactManifest

        directory = Path(spec["artifact_dir"])
        manifest = ArtifactManifest.model_validate_json(
            (directory / "manifest.json").read_text())
        executor = load_executor(directory, manifest)
        first = manifest.outputs[0].name
        config = manifest.runtime_config
        described = f"intra-op {config['intra_op_num_threads']}" \
            if config.get("intra_op_num_threads") else "ort default"
        if manifest.backend == "aotinductor":
            import torch

            described = f"torch {torch.get_num_threads()}"
        if manifest.backend == "openvino":
            described = f"openvino {config.get('performance_hint', '')}".strip()

        def run(feed: dict[str, np.ndarray]) -> np.ndarray:
            return np.asarray(executor.run(feed)[first])

        return run, described
    raise ValueError(f"unknown engine kind {kind!r}")


def _worker(conn: Any, spec: dict[str, Any]) -> None:
    """Load one engine, then answer the parent's commands until told to stop."""
    try:
        run, threads = _load(spec)
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"))
        return
    conn.send(("ready", threads))
    feed: dict[str, np.ndarray] = {}
    while True:
        command, *args = conn.recv()
        try:
            if command == "feed":
                feed = args[0]
                started = time.perf_counter()
                run(feed)  # warm up: first-call allocations, lazy initialization, compiling
                conn.send(("ok", time.perf_counter() - started))
            elif command == "outputs":
                conn.send(("ok", [run(f) for f in args[0]]))
            elif command == "time":
                # The share of the CPU other processes took meanwhile: this engine's own
                # threads are excluded, so a quiet machine reads near zero whatever its
                # thread count (the tuner judges its own rounds the same way).
                from compiler_worker.benchmark import CpuSampler

                samples, sampler = [], CpuSampler()
                sampler.start()
                block_started = time.perf_counter()
                while (len(samples) < args[0]
                       or time.perf_counter() - block_started < MIN_BLOCK_S):
                    started = time.perf_counter()
                    run(feed)
                    samples.append(time.perf_counter() - started)
                share = sampler.stop()
                conn.send(("ok", (samples, share.busy, share.steal)))
            elif command == "stop":
                conn.send(("ok", None))
                return
        except BaseException as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class Worker:
    """The parent's handle on one engine process."""

    def __init__(self, spec: dict[str, Any]) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker, args=(child, spec), daemon=True)
        self.process.start()
        child.close()
        status, value = self.conn.recv()
        if status != "ready":
            self.close()
            raise RuntimeError(value)
        self.threads = value

    def ask(self, *command: Any) -> Any:
        self.conn.send(command)
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send(("stop",))
                self.conn.recv()
            except (OSError, EOFError):
                pass
            self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


# --------------------------------------------------------------------------- preparation

def _samples(model_path: Path, count: int, seed: int) -> tuple[list[dict[str, np.ndarray]], str]:
    """``count`` feeds generated to fit the graph, and the rule applied, in words."""
    import onnx

    from compiler_worker.inputs import describe_generation, input_ranges
    from compiler_worker.modelio import signature
    from runtime_agent.samples import sample_inputs

    graph = onnx.load(str(model_path), load_external_data=False)
    specs, _ = signature(graph)
    ranges = input_ranges(graph)
    feeds = [sample_inputs(specs, seed=seed + i, ranges=ranges) for i in range(count)]
    rules = describe_generation(graph, specs)
    return feeds, "; ".join(f"{name}: {rule}" for name, rule in rules.items())


def _dataset(feeds: list[dict[str, np.ndarray]]) -> tuple[dict[str, np.ndarray], str]:
    """The feeds as a Kiln dataset (``[samples, *input shape]`` per input) and its id."""
    arrays = {name: np.stack([feed[name] for feed in feeds]) for name in feeds[0]}
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return arrays, hashlib.sha256(buffer.getvalue()).hexdigest()


def _quantize(model_path: Path, out_dir: Path, feeds: list[dict[str, np.ndarray]]
              ) -> list[Engine]:
    """The two int8 models a user makes by hand with onnxruntime.quantization."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.pending = iter(feeds)

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.pending, None)

        def rewind(self) -> None:
            self.pending = iter(feeds)

    engines = []
    jobs = [
        ("ort int8 dynamic", "int8-dynamic", "quantize_dynamic (defaults: QInt8 weights)",
         lambda out: quantize_dynamic(str(model_path), str(out))),
        ("ort int8 static QDQ", "int8-static-qdq",
         f"quantize_static QDQ, per-channel, QInt8, calibrated on {len(feeds)} samples",
         lambda out: quantize_static(str(model_path), str(out), Reader(),
                                     quant_format=QuantFormat.QDQ, per_channel=True,
                                     activation_type=QuantType.QInt8,
                                     weight_type=QuantType.QInt8)),
    ]
    for name, precision, note, quantize in jobs:
        out = out_dir / f"{precision}.onnx"
        started = time.perf_counter()
        try:
            quantize(out)
        except Exception as exc:  # onnxruntime.quantization raises untyped errors
            engines.append(Engine(name, "reduced peer", None, precision, note=note,
                                  error=f"quantization failed: {type(exc).__name__}: {exc}"))
            continue
        engines.append(Engine(name, "reduced peer", {"kind": "ort", "path": str(out), "level": 3},
                              precision, time.perf_counter() - started, note))
    return engines


def _openvino(model_path: Path, out_dir: Path, feeds: list[dict[str, np.ndarray]], *,
              reduced: bool) -> list[Engine]:
    """OpenVINO by hand: the exported model converted to IR once; fp32 (and, with ``reduced``,
    bf16 where the CPU has it, and NNCF post-training int8 on the samples)."""
    try:
        import openvino as ov
    except ImportError as exc:
        return [Engine("ov fp32", "fp32 peer", None, error=f"openvino is not installed: {exc}")]
    from runtime_agent.executors.openvino.executor import has_bf16
    from runtime_agent.fingerprint import detect_cpu

    started = time.perf_counter()
    ir = out_dir / "ov-fp32.xml"
    ov.save_model(ov.convert_model(str(model_path)), str(ir), compress_to_fp16=False)
    convert_s = time.perf_counter() - started
    engines = [Engine("ov fp32", "fp32 peer", {"kind": "ov", "path": str(ir),
                                               "precision": "f32"}, "fp32", convert_s,
                      "convert_model, CPU, LATENCY hint, INFERENCE_PRECISION_HINT f32")]
    if not reduced:
        return engines
    if has_bf16(detect_cpu()):
        engines.append(Engine("ov bf16", "reduced peer", {"kind": "ov", "path": str(ir),
                                                          "precision": "bf16"}, "bf16",
                              convert_s, "INFERENCE_PRECISION_HINT bf16 (AMX / AVX-512 BF16)"))
    else:
        engines.append(Engine("ov bf16", "reduced peer", None, "bf16",
                              error="this CPU has neither AMX-BF16 nor AVX-512 BF16"))
    try:
        import nncf

        from compiler_worker.backends.openvino.backend import is_transformer

        started = time.perf_counter()
        model = ov.convert_model(str(model_path))
        transformer = is_transformer(model)
        quantized = nncf.quantize(model, nncf.Dataset(feeds), subset_size=len(feeds),
                                  model_type=nncf.ModelType.TRANSFORMER if transformer
                                  else None)
        out = out_dir / "ov-int8.xml"
        ov.save_model(quantized, str(out), compress_to_fp16=False)
        engines.append(Engine(
            "ov int8 NNCF", "reduced peer", {"kind": "ov", "path": str(out)}, "int8",
            time.perf_counter() - started,
            f"nncf.quantize{' (transformer)' if transformer else ''} on {len(feeds)} samples, "
            f"plugin defaults"))
    except Exception as exc:  # NNCF raises untyped errors: reported in the table
        engines.append(Engine("ov int8 NNCF", "reduced peer", None, "int8",
                              error=f"NNCF failed: {type(exc).__name__}: {exc}"[:300]))
    return engines


def _kiln(blob: Path, precision: str, workdir: Path, samples: dict[str, np.ndarray],
          dataset_id: str, gate: dict[str, Any], backend: str | None = None) -> Engine:
    """Kiln's engine for ``precision``: tuned, verified and gated on the samples by ``gate``
    (the request's ``accuracy``: the gate the peers are judged by), by ``backend`` alone when
    given (``iree``, whose candidates race only when named)."""
    name = f"kiln {backend or precision}"
    try:
        from compiler_worker.pipeline import compile_model, write_artifact_dir
        from runtime_agent.fingerprint import detect_fingerprint
        from schemas.options import CompileOptions

        options = CompileOptions(tune="auto", precision=precision, samples=dataset_id,
                                 accuracy=gate, backends=[backend] if backend else [])
        started = time.perf_counter()
        result = compile_model(blob.read_bytes(), options, fingerprint=detect_fingerprint(),
                               workdir=workdir / "work", samples=samples)
        build_s = time.perf_counter() - started
        artifact = write_artifact_dir(result, workdir / "artifact")
    except Exception as exc:  # the tuner is new: a failure is reported, never fatal
        logger.warning("kiln %s build failed: %s", precision, exc)
        return Engine(name, "kiln", None, "n/a", error=f"{type(exc).__name__}: {exc}")
    manifest = result.manifest
    table = manifest.tuning
    note = f"policy {precision}"
    if table is not None:
        winner = table.candidate(table.winner) if table.winner else None
        passed = sum(c.outcome in ("won", "slower") for c in table.candidates)
        note = (f"policy {precision}: won {table.winner} of {len(table.candidates)} candidates "
                f"({passed} passed), tuning {table.elapsed_s:.1f} s over {table.rounds} rounds")
        if winner is not None and winner.accuracy is not None:
            note += f"; gate {winner.accuracy_metric} {winner.accuracy:.4f}"
        noise = table.noise
        if noise is not None:  # what the manifest recorded of the host while it measured
            busiest = max((x.busy for x in noise.samples), default=0.0)
            note += (f"; noise: {noise.measurements} measurement(s), host busy ≤ "
                     f"{busiest:.0%}, lock wait {noise.lock_wait_s:.1f} s, winner's spread "
                     f"{noise.spread.get(table.winner or '', 0.0):.1%}, "
                     f"fastest and runner-up {'apart' if noise.separable else 'within noise'}"
                     f"; {noise.verdict}")
    return Engine(name, "kiln", {"kind": "kiln", "artifact_dir": str(artifact)},
                  manifest.precision, build_s, note)


def _kiln_aoti(architecture: Any, workdir: Path, samples: dict[str, np.ndarray],
               dataset_id: str) -> Engine:
    """Kiln's AOTInductor engine: the module exported with torch.export, then compiled."""
    name = "kiln aotinductor"
    try:
        import torch

        from compiler_worker.pipeline import compile_model, write_artifact_dir
        from runtime_agent.fingerprint import detect_fingerprint
        from schemas.options import CompileOptions

        workdir.mkdir(parents=True, exist_ok=True)
        program = torch.export.export(architecture.module, architecture.torch_inputs())
        path = workdir / "model.pt2"
        torch.export.save(program, str(path))
        options = CompileOptions(backends=["aotinductor"], tune="auto", tuning_budget_s=240,
                                 samples=dataset_id)
        started = time.perf_counter()
        result = compile_model(path.read_bytes(), options, fingerprint=detect_fingerprint(),
                               workdir=workdir / "work", samples=samples)
        build_s = time.perf_counter() - started
        artifact = write_artifact_dir(result, workdir / "artifact")
    except Exception as exc:  # reported in the table, never fatal
        logger.warning("kiln aotinductor build failed: %s", exc)
        return Engine(name, "kiln", None, "n/a", error=f"{type(exc).__name__}: {exc}"[:300])
    table = result.manifest.tuning
    note = "torch.export → AOTInductor"
    if table is not None:
        note += (f": won {table.winner} of {len(table.candidates)} candidates, tuning "
                 f"{table.elapsed_s:.1f} s; max abs err vs eager "
                 f"{result.manifest.verification.max_abs_error:.2g}")
    return Engine(name, "kiln", {"kind": "kiln", "artifact_dir": str(artifact)}, "fp32",
                  build_s, note)


# --------------------------------------------------------------------------- measurement

#: The accuracy gate of ``_accuracy``, and the one Kiln's build is given (``_gate``): top-1
#: agreement for classifiers (``--top1`` sets it), the worst sample's cosine otherwise.
TOP1_GATE, COSINE_GATE = 0.99, 0.99


def _gate(kind: str, top1: float) -> dict[str, Any]:
    """The request's ``accuracy`` for a model whose output is ``kind``: the peers' gate."""
    if kind == "logits":
        return {"metric": "top1_agreement", "threshold": top1}
    return {"metric": "cosine", "threshold": COSINE_GATE}


def _accuracy(kind: str, outputs: list[np.ndarray], reference: list[np.ndarray],
              top1: float = TOP1_GATE) -> tuple[str, bool]:
    """The accuracy in words, and whether it meets the gate."""
    if kind == "logits":
        got = np.concatenate([o.reshape(-1, o.shape[-1]) for o in outputs]).argmax(-1)
        ref = np.concatenate([r.reshape(-1, r.shape[-1]) for r in reference]).argmax(-1)
        agree = float(np.mean(got == ref))
        return f"top-1 {agree * 100:.1f}% of {ref.size}", agree >= top1
    cosines = []
    for o, r in zip(outputs, reference, strict=True):
        o, r = o.astype(np.float64).ravel(), r.astype(np.float64).ravel()
        cosines.append(float(o @ r / (np.linalg.norm(o) * np.linalg.norm(r) + 1e-30)))
    return (f"cos {np.mean(cosines):.5f} (min {min(cosines):.5f})",
            min(cosines) >= COSINE_GATE)


def run_case(label: str, case: Case, args: argparse.Namespace, work: Path) -> None:
    from artifact_store.model_archive import pack_model_files
    from kiln.architectures import exported

    size = "small" if args.quick else "full"
    samples_count = min(case.samples, 8) if args.quick else case.samples
    model = exported(case.architecture, args.cache, size=size, batch=case.batch, seq=case.seq)
    architecture = model.architecture
    feeds, rule = _samples(model.path, samples_count, seed=1)
    arrays, dataset_id = _dataset(feeds)
    case_dir = work / label
    case_dir.mkdir(parents=True)
    blob = case_dir / "model.blob"
    pack_model_files(model.path, {p.name: p for p in model.files() if p != model.path}, blob)

    torch_spec: dict[str, Any] = {"kind": "torch", "architecture": case.architecture,
                                  "size": size, "batch": case.batch, "seed": 0,
                                  "threads": args.threads}
    if case.architecture in ("bert_base", "distilbert", "gpt2"):
        torch_spec["seq"] = case.seq
    skip = set(args.skip)
    engines = [Engine("pytorch eager", "fp32 peer", torch_spec),
               Engine("torch.compile", "fp32 peer", {**torch_spec, "compile": True},
                      note="Inductor, default mode; prepare = first call (cold compile)")]
    engines += [Engine(f"ort L{level}", "fp32 peer", {"kind": "ort", "path": str(model.path),
                                                      "level": level, "threads": args.threads},
                       note=ORT_LEVELS[level]) for level in ORT_LEVELS]
    print(f"[{label}] openvino by hand ...", file=sys.stderr)
    for engine in _openvino(model.path, case_dir, feeds, reduced=not args.fp32_only):
        if engine.spec is not None:
            engine.spec["threads"] = args.threads
        engines.append(engine)
    if not args.fp32_only:
        print(f"[{label}] quantizing by hand ...", file=sys.stderr)
        int8 = _quantize(model.path, case_dir, feeds)
        for engine in int8:
            if engine.spec is not None:
                engine.spec["threads"] = args.threads
        engines += int8
    for precision in ("fp32",) if args.fp32_only else ("fp32", "auto"):
        print(f"[{label}] kiln build, precision {precision} ...", file=sys.stderr)
        engines.append(_kiln(blob, precision, case_dir / f"kiln-{precision}", arrays,
                             dataset_id, _gate(architecture.output, args.top1)))
    if importlib.util.find_spec("iree.compiler") is not None and "kiln iree" not in skip:
        # IREE's llvm-cpu engines for this CPU, timed beside onnxruntime's: the tuner races
        # them only when a request names the backend, so this row says whether it should.
        print(f"[{label}] kiln build, backend iree ...", file=sys.stderr)
        engines.append(_kiln(blob, "fp32", case_dir / "kiln-iree", arrays, dataset_id,
                             _gate(architecture.output, args.top1), backend="iree"))
    if "kiln aotinductor" not in skip:
        print(f"[{label}] kiln build, torch.export → aotinductor ...", file=sys.stderr)
        engines.append(_kiln_aoti(architecture, case_dir / "kiln-aoti", arrays, dataset_id))
    # Rows left out on request are dropped before any process loads them; the reference
    # (ort L0) cannot be.
    engines = [e for e in engines if e.name not in skip or e.name == "ort L0"]

    workers: dict[str, Worker] = {}
    retaken: dict[str, int] = {}
    try:
        for engine in engines:
            if engine.spec is None:
                continue
            try:
                workers[engine.name] = Worker(engine.spec)
                engine.threads = workers[engine.name].threads
                warmup = workers[engine.name].ask("feed", architecture.inputs)
                if engine.spec.get("compile"):
                    engine.prepare_s = warmup
            except RuntimeError as exc:
                engine.error = str(exc).splitlines()[0]
                workers.pop(engine.name, None)
        live = [e for e in engines if e.name in workers]
        print(f"[{label}] accuracy on {len(feeds)} samples ...", file=sys.stderr)
        reference = workers["ort L0"].ask("outputs", feeds)
        for engine in live:
            outputs = workers[engine.name].ask("outputs", feeds)
            engine.accuracy, engine.gated = _accuracy(architecture.output, outputs, reference,
                                                      args.top1)
        from compiler_worker.tuner_measure import BUSY_THRESHOLD, STEAL_THRESHOLD, is_quiet

        load, others, steal = [os.getloadavg()[0]], [], []
        for r in range(args.rounds):
            print(f"[{label}] round {r + 1}/{args.rounds}", file=sys.stderr)
            for i in range(len(live)):
                engine = live[(i + r) % len(live)]
                for attempt in range(1 + RETAKES):
                    # Runtimes spin-wait a while after a call: let the engine timed before
                    # this one go idle, or its threads share the cores with this one's block.
                    time.sleep(IDLE_GAP_S)
                    times, busy, stolen = workers[engine.name].ask("time", args.iters)
                    if is_quiet(busy, stolen):
                        break
                    if attempt < RETAKES:  # another process took the CPU: not a figure
                        retaken[engine.name] = retaken.get(engine.name, 0) + 1
                engine.times += times
                others.append(busy)
                steal.append(stolen)
            load.append(os.getloadavg()[0])
    finally:
        for worker in workers.values():
            worker.close()
    _print_case(label, case, model.exporter, size, rule, engines,
                _gate(architecture.output, args.top1))
    # One engine runs at a time, and its own threads count in the load average (about as
    # many as the machine has cores on a quiet machine). What says whether anything else
    # shared the cores is the CPU share of other processes while each engine was timed,
    # judged by the tuner's own thresholds: a block timed above them is taken again (up to
    # RETAKES times), and a table with one left above them is no result.
    loaded = not is_quiet(max(others, default=0.0), max(steal, default=0.0))
    if retaken:
        print("\nBlocks taken again because another process took the CPU meanwhile: "
              + ", ".join(f"{name} {n}" for name, n in sorted(retaken.items())))
    print(f"\nOther processes' share of the CPU while each engine was timed: median "
          f"{statistics.median(others or [0.0]):.0%}, max {max(others, default=0.0):.0%}; "
          f"steal max {max(steal, default=0.0):.0%} (thresholds {BUSY_THRESHOLD:.0%} / "
          f"{STEAL_THRESHOLD:.0%}); load average {min(load):.2f}–{max(load):.2f} on "
          f"{os.cpu_count()} logical CPUs"
          + (" — **loaded: measure again on a quiet machine**" if loaded else " — quiet"))


def _print_case(label: str, case: Case, exporter: str, size: str, rule: str,
                engines: list[Engine], gate: dict[str, Any]) -> None:
    def best(group: str) -> float | None:
        medians = [statistics.median(e.times) for e in engines if e.group == group and e.times]
        return min(medians) if medians else None

    best_fp32, best_reduced = best("fp32 peer"), best("reduced peer")
    gated = [statistics.median(e.times) for e in engines
             if e.group != "kiln" and e.times and e.gated]
    best_gated = min(gated) if gated else None
    shape = f"batch {case.batch}" + (f", seq {case.seq}" if case.architecture != "mlp"
                                     and "resnet" not in case.architecture else "")
    print(f"\n### {label}: {case.architecture} ({size}, {shape}; exporter: {exporter})\n")
    print(f"Samples: {rule}\n")
    print(f"Gate (the peers', and Kiln's request's): {gate['metric']} >= {gate['threshold']:g}\n")
    print("| engine | precision | latency ms, median [min–max] | speed-up vs best fp32 peer "
          "| speed-up vs best reduced-precision peer | accuracy vs fp32 (ORT L0) | gate "
          "| vs best gated peer | prepare s | threads | notes |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for e in engines:
        if not e.times:
            print(f"| {e.name} | {e.precision} | n/a | n/a | n/a | n/a | n/a | n/a | "
                  f"{_num(e.prepare_s)} | — | {e.error or e.note} |")
            continue
        median = statistics.median(e.times)
        latency = f"{median * 1e3:.3f} [{min(e.times) * 1e3:.3f}–{max(e.times) * 1e3:.3f}]"
        ratio = f"{median / best_gated:.2f}" if best_gated and e.gated else "—"
        print(f"| {e.name} | {e.precision} | {latency} | {_speedup(best_fp32, median)} | "
              f"{_speedup(best_reduced, median)} | {e.accuracy} | "
              f"{'pass' if e.gated else 'miss'} | {ratio} | {_num(e.prepare_s)} | {e.threads} | "
              f"{e.note} |")
    kiln_fp32 = [e for e in engines if e.name in ("kiln fp32", "kiln aotinductor") and e.times]
    if kiln_fp32:
        pick = min(kiln_fp32, key=lambda e: statistics.median(e.times))
        others = ", ".join(f"{e.name} {statistics.median(e.times) * 1e3:.3f} ms"
                           for e in kiln_fp32 if e is not pick)
        print(f"\nFastest verified Kiln fp32 engine: **{pick.name}** "
              f"({statistics.median(pick.times) * 1e3:.3f} ms median"
              f"{'; ' + others if others else ''}); spread = min–max of "
              f"{len(pick.times)} timed calls.")
    sys.stdout.flush()


def _speedup(best: float | None, median: float) -> str:
    """How many times faster than ``best`` (below 1: slower)."""
    return f"{best / median:.2f}×" if best else "—"


def _num(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(CASES),
                        help=f"comma-separated, from {', '.join(CASES)}")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (10)")
    parser.add_argument("--iters", type=int, default=None, help="timed calls per round (20)")
    parser.add_argument("--quick", action="store_true",
                        help="small configs, 2 rounds of 5: a smoke run, not a measurement")
    parser.add_argument("--skip", type=lambda v: [n.strip() for n in v.split(",") if n.strip()],
                        default=[], help="engines to leave out, by row name, comma-separated "
                        "(e.g. 'torch.compile,kiln aotinductor': their cold builds dominate "
                        "a run's time)")
    parser.add_argument("--fp32-only", action="store_true",
                        help="skip the reduced-precision peers and Kiln's auto policy (a "
                             "shorter run)")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads for the peers (default: each runtime's own)")
    parser.add_argument("--cache", type=Path, default=Path(".kiln") / "bench-models",
                        help="where exported models are cached")
    parser.add_argument("--top1", type=float, default=TOP1_GATE,
                        help="the classifiers' gate, a share of top-1 agreement (0.99): the "
                             "peers are judged by it and Kiln's builds are given it. Random "
                             "weights leave near-tied logits that a lower share tells apart")
    args = parser.parse_args()
    if not 0 < args.top1 <= 1:
        parser.error(f"--top1 is a share in (0, 1]; got {args.top1}")
    args.rounds = args.rounds or (2 if args.quick else 10)
    args.iters = args.iters or (5 if args.quick else 20)
    labels = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in labels if m not in CASES]
    if unknown:
        parser.error(f"unknown models {unknown}; available: {', '.join(CASES)}")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    import onnxruntime
    import torch
    import transformers

    print("## Engines: Kiln beside the peers, same run, interleaved rounds\n")
    from runtime_agent.fingerprint import detect_fingerprint

    fingerprint = detect_fingerprint()
    cpu = fingerprint.cpu
    print(f"{cpu.model or platform.machine()}, {os.cpu_count()} logical CPUs "
          f"(features: {', '.join(cpu.features) or 'none read'}); "
          f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__}, "
          f"openvino {fingerprint.runtimes.get('openvino') or 'not installed'}, "
          f"transformers {transformers.__version__}; {args.rounds} rounds × {args.iters} "
          f"calls per engine{' (--quick: small configs)' if args.quick else ''}")
    print(f"\n`{' '.join(['bench/engines.py', *sys.argv[1:]])}`")
    with tempfile.TemporaryDirectory(prefix="kiln-bench-engines-") as tmp:
        for label in labels:
            run_case(label, CASES[label], args, Path(tmp))


if __name__ == "__main__":
    main()

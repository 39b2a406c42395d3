"""Kiln's GPU paths beside their bare peers, on one NVIDIA GPU, in one run.

Per model (an MLP 1024 wide, 3 layers; ResNet-50 from transformers with random weights,
exported by ``torch.onnx.export``'s default exporter), batch 1, one call at a time, each call
followed by a device synchronize so the figure is the caller's latency:

- onnxruntime's CUDA execution provider, bare: an IOBinding on torch tensors bound once (the
  fastest the bare API offers, for tensors that never change) and one made on every call (what
  a caller with new tensors each call does); against ``kiln.runtime`` with torch tensors and
  ``out=`` buffers, ``kiln.torch`` eagerly, and ``kiln.torch`` inside
  ``torch.compile(fullgraph=True)``;
- host arrays: ``InferenceSession.run`` on numpy against ``kiln.runtime.run`` on numpy;
- the eager PyTorch module on CUDA, for scale;
- AOTInductor's CUDA package built by Kiln's pipeline (``--aoti``), run by the agent's executor
  (numpy in and out), against the eager module fed the same way.

Paths alternate in blocks (the order reversed every round); the table gives the median with
the interquartile range, and each path's difference from its peer measured in the same run.

    python bench/gpu.py [--models mlp,resnet50] [--rounds 6] [--block 200] [--aoti]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import blocks


def artifact_on_cuda(model: bytes, out: Path) -> Path:
    """The model compiled by Kiln's pipeline on this machine (onnxruntime, level 1: a portable
    engine), its manifest then naming the CUDA execution provider, as a GPU node's would."""
    from compiler_worker.pipeline import compile_model, write_artifact_dir
    from runtime_agent.fingerprint import detect_fingerprint
    from schemas.options import CompileOptions

    result = compile_model(model, CompileOptions(optimization_level=1, tune="off"),
                           fingerprint=detect_fingerprint(), workdir=out.with_name("work"))
    config = {**result.manifest.runtime_config,
              "providers": ["CUDAExecutionProvider", "CPUExecutionProvider"]}
    manifest = result.manifest.model_copy(update={"runtime_config": config})
    directory = write_artifact_dir(result, out)
    (directory / "manifest.json").write_text(manifest.model_dump_json())
    return directory


def table(title: str, samples: dict[str, list[float]], peers: dict[str, str]) -> list[dict]:
    rows = []
    print(f"\n{title}")
    print("| path | median µs | IQR µs | vs peer |")
    print("|---|---|---|---|")
    for name, values in samples.items():
        q = statistics.quantiles(values, n=4)
        median = statistics.median(values) * 1e6
        peer = peers.get(name)
        versus = ""
        if peer:
            base = statistics.median(samples[peer]) * 1e6
            versus = f"{median - base:+.1f} µs ({median / base:.3f}×) vs {peer}"
        print(f"| {name} | {median:.1f} | {q[0] * 1e6:.1f}–{q[2] * 1e6:.1f} | {versus} |")
        rows.append({"path": name, "median_us": median, "q1_us": q[0] * 1e6,
                     "q3_us": q[2] * 1e6, "peer": peer})
    return rows


def ort_paths(artifact: Path, module: object, feed: dict[str, np.ndarray]
              ) -> tuple[dict[str, Callable[[], object]], dict[str, str]]:
    import onnxruntime as ort
    import torch

    import kiln.torch as kiln_torch
    from kiln import runtime
    from runtime_agent.artifact_dir import read_manifest
    from runtime_agent.executors.onnxruntime.executor import session_options

    manifest = read_manifest(artifact)
    config = manifest.runtime_config
    session = ort.InferenceSession(str(next(artifact.glob("engine*"))), session_options(config),
                                   providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    output = manifest.outputs[0].name
    names = list(feed)
    cuda_in = {name: torch.from_numpy(value).cuda() for name, value in feed.items()}
    want = session.run([output], feed)[0]
    out = torch.empty(want.shape, dtype=torch.float32, device="cuda")
    binding = session.io_binding()
    for name, tensor in cuda_in.items():
        binding.bind_input(name, "cuda", 0, np.float32, list(tensor.shape), tensor.data_ptr())
    binding.bind_output(output, "cuda", 0, np.float32, list(out.shape), out.data_ptr())
    loaded = runtime.load(artifact)
    engine = kiln_torch.load(artifact)
    compiled = torch.compile(lambda *xs: engine(*xs), fullgraph=True)
    args = [cuda_in[name] for name in names]
    eager = module.cuda().eval()
    with torch.inference_mode():
        loaded.run(cuda_in, out={output: out})
        for got in (loaded.run(feed)[output], out, engine(*args), compiled(*args)):
            value = got.cpu().numpy() if hasattr(got, "cpu") else got
            np.testing.assert_allclose(value, want, rtol=2e-3, atol=2e-3)

    def inference(fn: Callable[..., object]) -> Callable[[], object]:
        def call() -> object:
            with torch.inference_mode():
                return fn(*args)
        return call

    def rebind() -> None:
        """What a caller of the bare API does with new tensors on every call."""
        fresh = session.io_binding()
        for name, tensor in cuda_in.items():
            fresh.bind_input(name, "cuda", 0, np.float32, list(tensor.shape), tensor.data_ptr())
        fresh.bind_output(output, "cuda", 0, np.float32, list(out.shape), out.data_ptr())
        session.run_with_iobinding(fresh)

    paths = {
        "bare session, IOBinding on torch tensors": lambda: session.run_with_iobinding(binding),
        "bare session, IOBinding made each call": rebind,
        "kiln.runtime run(torch tensors, out=)": lambda: loaded.run(cuda_in, out={output: out}),
        "kiln.torch module, eager": inference(engine),
        "kiln.torch in torch.compile(fullgraph)": inference(compiled),
        "bare session.run(numpy)": lambda: session.run([output], feed),
        "kiln.runtime run(numpy)": lambda: loaded.run(feed),
        "eager PyTorch module on CUDA": inference(eager),
    }
    peers = {
        "bare session, IOBinding made each call": "bare session, IOBinding on torch tensors",
        "kiln.runtime run(torch tensors, out=)": "bare session, IOBinding made each call",
        "kiln.torch module, eager": "kiln.runtime run(torch tensors, out=)",
        "kiln.torch in torch.compile(fullgraph)": "kiln.runtime run(torch tensors, out=)",
        "kiln.runtime run(numpy)": "bare session.run(numpy)",
        "eager PyTorch module on CUDA": "bare session, IOBinding on torch tensors",
    }
    return paths, peers


def aoti_paths(work: Path, module: object, feed: dict[str, np.ndarray]
               ) -> tuple[dict[str, Callable[[], object]], dict[str, str], dict]:
    """An AOTInductor CUDA package built by the pipeline, run by the agent's executor."""
    import torch

    from compiler_worker.backends import AOTInductorBackend
    from compiler_worker.pipeline import compile_model, plan_build, write_artifact_dir
    from kiln import runtime
    from runtime_agent.fingerprint import detect_fingerprint
    from schemas.options import CompileOptions

    fingerprint = detect_fingerprint()
    args = tuple(torch.from_numpy(value) for value in feed.values())
    program = torch.export.export(module.cpu().eval(), args)
    work.mkdir(parents=True, exist_ok=True)
    path = work / "model.pt2"
    torch.export.save(program, str(path))
    options = CompileOptions(backends=["aotinductor"], optimization_level=1)
    key = AOTInductorBackend().fingerprint_key(fingerprint)
    plan = plan_build("0" * 64, options, fingerprint, key=key, model_format="torch-export")
    started = time.perf_counter()
    result = compile_model(path.read_bytes(), options, fingerprint=fingerprint,
                           workdir=work / "aoti-work", plan=plan)
    build_s = time.perf_counter() - started
    directory = write_artifact_dir(result, work / "aoti")
    loaded = runtime.load(directory)
    eager = module.cuda().eval()
    output = result.manifest.outputs[0].name

    def eager_numpy() -> object:
        with torch.inference_mode():
            return eager(*(a.cuda() for a in (torch.from_numpy(v) for v in feed.values()))
                         ).cpu().numpy()

    got = loaded.run(feed)[output]
    np.testing.assert_allclose(got, eager_numpy(), rtol=2e-3, atol=2e-3)
    info = {"build_s": build_s, "key": result.manifest.fingerprint_key,
            "candidate": result.manifest.runtime_config.get("candidate"),
            "pipeline_p50_ms": result.manifest.benchmark.p50_ms}
    return ({"AOTInductor CUDA package via kiln.runtime (numpy)": lambda: loaded.run(feed),
             "eager PyTorch on CUDA (numpy in and out)": eager_numpy},
            {"AOTInductor CUDA package via kiln.runtime (numpy)":
             "eager PyTorch on CUDA (numpy in and out)"}, info)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,resnet50")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--block", type=int, default=200)
    parser.add_argument("--aoti", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--work", type=Path)
    args = parser.parse_args()

    import torch

    from kiln import architectures

    if not torch.cuda.is_available():
        sys.exit("bench/gpu.py needs a CUDA GPU that torch sees")
    # The peers are fp32 engines: eager PyTorch in full fp32 too (torch lets cuDNN use TF32
    # by default), as Kiln runs an fp32 AOTInductor package.
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    import onnxruntime as ort

    print(f"onnxruntime {ort.__version__}: {ort.get_available_providers()}")
    work = args.work or Path(tempfile.mkdtemp(prefix="kiln-gpu-bench-"))
    report: dict[str, object] = {"gpu": torch.cuda.get_device_name(),
                                 "torch": torch.__version__, "onnxruntime": ort.__version__}

    def measure(paths: dict[str, Callable[[], object]]) -> dict[str, list[float]]:
        return blocks(paths, args.rounds, args.block, skip=10, settle=torch.cuda.synchronize)

    for name in args.models.split(","):
        built = architectures.exported(name, work / "exports")
        import onnx

        blob = onnx.load(str(built.path)).SerializeToString()
        feed = dict(built.architecture.inputs)
        module = built.architecture.module
        if "CUDAExecutionProvider" in ort.get_available_providers():
            artifact = artifact_on_cuda(blob, work / name / "artifact")
            paths, peers = ort_paths(artifact, module, feed)
            report[f"{name}/onnxruntime-cuda"] = table(
                f"{name}, batch 1: onnxruntime on CUDA ({args.rounds} rounds × {args.block})",
                measure(paths), peers)
        else:
            print(f"\n{name}: onnxruntime has no CUDA execution provider here; skipped")
        if args.aoti:
            paths, peers, info = aoti_paths(work / name, module, feed)
            print(f"\nAOTInductor build through the pipeline: {info}")
            report[f"{name}/aotinductor-cuda"] = {"build": info, "rows": table(
                f"{name}, batch 1: AOTInductor CUDA package ({args.rounds} rounds × "
                f"{args.block})", measure(paths), peers)}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

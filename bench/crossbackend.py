"""One PyTorch program, two backends: which engine Kiln gives an agent, and whether timing the
two again side by side agrees.

For each model, the module is exported with ``torch.export`` (``.pt2``) and submitted to the
embedded stack (``kiln api``, one ``kiln worker``, one ``kiln agent`` as processes): a job for
the worker's AOTInductor key and one for its onnxruntime key (which exports the program to
ONNX in its build step). Each build verifies its engine against the eager program and records
a p50 measured on the build host. The program is then deployed to the agent, and the engine
the agent serves is Kiln's pick (``services/api/engine_choice.py``: the lowest recorded p50
of the best tier), with the reason the agent lists (``GET /v1/models``, ``choice``).

Then both artifacts are downloaded, signature-checked and loaded in this process with
``kiln.runtime.load`` (the agent's executors), and re-timed side by side on the same feed:
``--rounds`` interleaved rounds (round ``r`` starts with engine ``r mod 2``), each a block
of untimed warm-up calls then ``--iters`` timed calls of one engine (blocks, not alternate
calls: one onnxruntime session's spinning threads would otherwise slow the next engine);
each round yields one p50 per engine, and the table gives the median of those and their
spread [min–max]. "agrees" says whether the engine with the lower re-timed p50 is the one
Kiln picked; "within spread" when the two engines' spreads overlap (the re-timing cannot
tell them apart).

Models (batch 8): ``mlp`` 256 → 1024 → 1024 → 10 (ReLU); ``cnn`` on 3×32×32 (two 3×3
convolutions with ReLU and max-pooling, 32 and 64 channels, then 4096 → 128 → 10);
``resnet50`` (the transformers ResNet-50 of ``kiln.architectures``, written without
torchvision; a long AOTInductor build, so only when named). Builds use ``tune: off`` (each
backend's default candidate) unless ``--tune auto``.

    .venv/bin/python bench/crossbackend.py
    .venv/bin/python bench/crossbackend.py --models mlp,cnn,resnet50 --rounds 15 --iters 50
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from _common import console, free_port
from rich.table import Table

from kiln.client import KilnClient
from kiln.stack import EmbeddedStack
from schemas.jobs import JobStatus
from schemas.options import CompileOptions

BATCH = 8


def mlp_module():
    import torch

    return torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(), torch.nn.Linear(1024, 10)).eval(), (BATCH, 256)


def cnn_module():
    import torch

    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(64 * 8 * 8, 128), torch.nn.ReLU(),
        torch.nn.Linear(128, 10)).eval(), (BATCH, 3, 32, 32)


def resnet50_module():
    from kiln.architectures import resnet50

    architecture = resnet50(batch=BATCH)
    (example,) = architecture.torch_inputs()
    return architecture.module.eval(), tuple(example.shape)


MODELS: dict[str, Callable[[], tuple[object, tuple[int, ...]]]] = {
    "mlp": mlp_module, "cnn": cnn_module, "resnet50": resnet50_module}


def export(name: str, folder: Path) -> Path:
    import torch

    torch.manual_seed(0)
    module, shape = MODELS[name]()
    program = torch.export.export(module, (torch.randn(*shape),))
    path = folder / f"{name}.pt2"
    torch.export.save(program, str(path))
    return path


def wait_keys(client: KilnClient) -> tuple[str, str]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        keys = client.live_fingerprint_keys("torch-export")
        ort = [k for k in keys if k.startswith("ort-")]
        aoti = [k for k in keys if k.startswith("aoti-")]
        if ort and aoti:
            return ort[0], aoti[0]
        time.sleep(0.3)
    raise RuntimeError("no worker serving both an onnxruntime and an AOTInductor key for "
                       "torch programs")


def served(stack: EmbeddedStack, deployment: str, want: set[str],
           timeout_s: float = 300) -> dict:
    """The agent's entry for ``deployment`` once it serves with both backends weighed."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            listed = httpx.get(f"{stack.agent_url}/v1/models", timeout=5).json()
        except (httpx.TransportError, ValueError):
            listed = []
        for model in listed:
            choice = model.get("name") == deployment and model.get("choice")
            if choice and {c["backend"] for c in choice["candidates"]} >= want:
                return model
        time.sleep(0.3)
    raise RuntimeError(f"the agent did not serve {deployment} with {sorted(want)} weighed "
                       f"within {timeout_s}s (see {stack.home / 'logs'})")


def retime(engines: dict[str, object], feed: dict[str, np.ndarray], rounds: int, iters: int,
           warmup: int = 5) -> dict[str, list[float]]:
    """Per engine, one p50 (ms) per round; rounds interleave the engines in blocks."""
    names = list(engines)
    p50s: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            run = engines[name].run  # type: ignore[attr-defined]
            for _ in range(warmup):
                run(feed)
            samples = []
            for _ in range(iters):
                started = time.perf_counter()
                run(feed)
                samples.append((time.perf_counter() - started) * 1000)
            p50s[name].append(statistics.median(samples))
    return p50s


def download(client: KilnClient, artifact_id: str, folder: Path) -> Path:
    from runtime_agent.executors import MANIFEST_FILENAME, blob_filename

    folder.mkdir(parents=True)
    for ref in client.get_manifest(artifact_id).blobs:
        client.download_blob(artifact_id, ref, folder / blob_filename(ref))
    (folder / MANIFEST_FILENAME).write_bytes(client.get_signed_manifest(artifact_id))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp,cnn",
                        help=f"comma-separated, of {sorted(MODELS)}")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--tune", choices=["off", "auto"], default="off")
    args = parser.parse_args()
    names = [n for n in args.models.split(",") if n]
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {sorted(MODELS)}")

    from kiln.runtime import load

    options = CompileOptions(tune=args.tune)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kiln-crossbackend-") as tmp:
        work = Path(tmp)
        stack = EmbeddedStack(home=work / "kiln", port=free_port(), agent_labels="bench=xb",
                              agent_port=free_port(), pool="solo")
        with stack:
            client = stack.client()
            ort_key, aoti_key = wait_keys(client)
            console.print(f"worker keys: onnxruntime {ort_key}, aotinductor {aoti_key}")
            for name in names:
                pt2 = export(name, work)
                model = client.upload_model(pt2, name=name)
                jobs = client.create_jobs(model.id, [ort_key, aoti_key], options)
                done = {j.fingerprint_key: client.wait_job(j.id, timeout_s=3600) for j in jobs}
                built, failed = {}, {}
                for key, job in done.items():
                    backend = "onnxruntime" if key == ort_key else "aotinductor"
                    if job.status is JobStatus.SUCCEEDED:
                        built[backend] = job
                    else:
                        failed[backend] = job.error.code if job.error else job.status.value
                if failed:
                    console.print(f"[yellow]{name}: failed builds {failed}")
                client.deploy(name, model.id, selector={"bench": "xb"}, options=options)
                entry = served(stack, name, set(built))
                picked, choice = entry["backend"], entry["choice"]
                engines, manifests = {}, {}
                for backend, job in built.items():
                    folder = download(client, job.artifact_id, work / name / backend)
                    engines[backend] = load(folder, trusted_keys=[stack.home /
                                                                  "signing.key.pub"])
                    manifests[backend] = client.get_manifest(job.artifact_id)
                spec = manifests[picked].inputs[0]
                feed = {spec.name: np.random.default_rng(0).standard_normal(
                    [int(d) for d in spec.shape], dtype=np.float32)}
                p50s = retime(engines, feed, args.rounds, args.iters)
                medians = {b: statistics.median(v) for b, v in p50s.items()}
                fastest = min(medians, key=medians.__getitem__)
                spans = [(min(v), max(v)) for v in p50s.values()]
                overlap = len(spans) > 1 and max(lo for lo, _ in spans) <= min(
                    hi for _, hi in spans)
                agrees = ("yes" if fastest == picked else "no") + (
                    " (within spread)" if overlap else "")
                for backend, job in built.items():
                    build_s = (job.finished_at - job.started_at).total_seconds() \
                        if job.finished_at and job.started_at else float("nan")
                    rows.append((name, backend, manifests[backend].benchmark.p50_ms,
                                 medians[backend], min(p50s[backend]), max(p50s[backend]),
                                 build_s, "← picked (" + choice["reason"] + ")"
                                 if backend == picked else "", agrees if backend == picked
                                 else ""))
                for backend, code in failed.items():
                    rows.append((name, backend, None, None, None, None, None,
                                 f"build failed: {code}", ""))
                for engine in engines.values():
                    close = getattr(engine, "close", None)
                    if close is not None:
                        close()

    table = Table(title=f"one torch.export program, both backends (batch {BATCH}, tune "
                        f"{args.tune}; re-timed: {args.rounds} rounds × {args.iters} calls, "
                        f"side by side in this run)")
    for column in ("model", "backend", "recorded p50 (build host)", "re-timed p50 median",
                   "re-timed spread", "build s", "Kiln's pick", "re-timing agrees"):
        table.add_column(column)
    for name, backend, recorded, median, lo, hi, build_s, pick, agrees in rows:
        table.add_row(
            name, backend, "—" if recorded is None else f"{recorded:.3f} ms",
            "—" if median is None else f"{median:.3f} ms",
            "—" if lo is None else f"\\[{lo:.3f}–{hi:.3f}] ms",
            "—" if build_s is None else f"{build_s:.1f}", pick, agrees)
    console.print(table)


if __name__ == "__main__":
    main()

"""What the sandbox costs: each untrusted step in its bounded child against the same step in
the calling process, and the least address space a child needs to import the toolchain.

Rows: a bare child round trip (interpreter start, confinement, JSON both ways); the API's
model inspection (a small ``.onnx``); a whole compile of the MLP
(``kiln.examples.mlp``, few samples). A second table times a bare child with and without its
process bounds (PID namespace and fresh ``/proc``, pids cgroup, the Unix-socket filter) in
interleaved pairs. The address-space column halves the search interval
until it is under 64 MiB: the smallest ``RLIMIT_AS`` under which a child imports each module.

    .venv/bin/python bench/sandbox.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import console, fmt
from rich.table import Table

from artifact_store.inspection import check_upload
from artifact_store.sandbox import Limits, run_sandboxed
from compiler_worker.pipeline import compile_model, plan_build
from compiler_worker.sandbox import Sandbox
from kiln.examples import mlp
from runtime_agent.fingerprint import detect_fingerprint
from schemas._canonical import sha256_hex
from schemas.options import CompileOptions
from services.api.inspection import check_model_upload
from services.config import KilnSettings

MIB = 1 << 20


def _time(fn, repeats: int, cpu: list[float] | None = None) -> list[float]:
    """Wall seconds per call; the children's CPU seconds (user + system) go to ``cpu``."""
    samples = []
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if cpu is not None:
            cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return samples


def least_address_space(module: str, low: int = 64 * MIB, high: int = 8192 * MIB) -> int:
    """The smallest RLIMIT_AS (within 64 MiB) under which ``import module`` succeeds."""
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, "
            "(int(sys.argv[1]), int(sys.argv[1]))); import " + module)
    while high - low > 64 * MIB:
        middle = (low + high) // 2
        ok = subprocess.run([sys.executable, "-c", code, str(middle)], capture_output=True,
                            check=False).returncode == 0
        low, high = (low, middle) if ok else (middle, high)
    return high


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    settings = KilnSettings(env="dev")
    model = mlp()
    data = model.SerializeToString()
    options = CompileOptions(verify_samples=2, benchmark_iterations=3)
    fingerprint = detect_fingerprint()
    plan = plan_build(sha256_hex(data), options, fingerprint)
    sandbox = Sandbox(Limits(wall_s=600))

    with tempfile.TemporaryDirectory(prefix="kiln-bench-") as tmp:
        root = Path(tmp)
        upload = root / "model.onnx"
        upload.write_bytes(data)
        counter = iter(range(1_000_000))

        def fresh() -> Path:
            path = root / f"run-{next(counter)}"
            path.mkdir()
            return path

        rows = [
            ("child round trip (no work)",
             lambda: run_sandboxed("artifact_store.sandbox", "noop", {}, scratch=fresh(),
                                   limits=Limits(), stage="bench"), None),
            ("API: inspect a model upload",
             lambda: check_model_upload([("model.onnx", upload)], fresh() / "model",
                                        settings=settings),
             lambda: check_upload([("model.onnx", upload)], fresh() / "model",
                                  max_bytes=settings.max_upload_bytes)),
        ]
        table = Table(title=f"the sandbox's cost (median \\[min–max] of {args.repeats})")
        for column in ("step", "in a bounded child (wall)", "the child's CPU",
                       "in the calling process (wall)"):
            table.add_column(column)
        for name, sandboxed, direct in rows:
            cpu: list[float] = []
            child = fmt(_time(sandboxed, args.repeats, cpu), 1000, "ms", 0)
            own = fmt(_time(direct, args.repeats), 1000, "ms", 1) if direct else "—"
            table.add_row(name, child, fmt(cpu, 1000, "ms", 0), own)
        cpu = []
        child = _time(lambda: sandbox.compile_model(data, options, fingerprint=fingerprint,
                                                    workdir=fresh(), plan=plan), 1, cpu)
        own = _time(lambda: compile_model(data, options, fingerprint=fingerprint,
                                          workdir=fresh(), plan=plan), 1)
        table.add_row("worker: compile the MLP (tuning, one run)", fmt(child, 1, "s", 2),
                      fmt(cpu, 1, "s", 2), fmt(own, 1, "s", 2))
        console.print(table)

        bounds = Table(title=f"the process bounds' cost: a bare child, {args.repeats * 3} "
                             f"interleaved pairs (median \\[min–max])")
        for column in ("limits", "wall", "the child's CPU"):
            bounds.add_column(column)
        variants = {"all bounds (default)": Limits(),
                    "no PID namespace, pids cgroup or socket filter":
                        Limits(process_isolation=False, processes=None,
                               unix_socket_isolation=False)}
        walls: dict[str, list[float]] = {name: [] for name in variants}
        cpus: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.repeats * 3):
            for name, limits in variants.items():
                walls[name] += _time(lambda limits=limits: run_sandboxed(
                    "artifact_store.sandbox", "noop", {}, scratch=fresh(), limits=limits,
                    stage="bench"), 1, cpus[name])
        for name in variants:
            bounds.add_row(name, fmt(walls[name], 1000, "ms", 0), fmt(cpus[name], 1000, "ms", 0))
        console.print(bounds)

    space = Table(title="least address space (RLIMIT_AS) to import, within 64 MiB")
    space.add_column("module")
    space.add_column("RLIMIT_AS")
    for module in ("numpy", "onnx", "onnxruntime", "compiler_worker.pipeline", "torch"):
        space.add_row(module, f"{least_address_space(module) // MIB} MiB")
    console.print(space)


if __name__ == "__main__":
    main()

"""What the sandbox costs: each untrusted step in its bounded child against the same step in
the calling process, and the least address space a child needs to import the toolchain.

Rows: a bare child round trip (confinement, JSON both ways); the API's model inspection (a
small ``.onnx``); a whole compile of the MLP (``kiln.examples.mlp``, few samples). Each row
runs its child both ways, interleaved: forked from its entry point's fork server (the
default; the server started once beforehand, its start a row of its own) and started as a
fresh interpreter. The CPU column is the host's busy time outside this process while the step
ran (the child, its waiter, the server): read it on a quiet machine, whose load the table's
foot prints. A second table times a bare child with and without its
process bounds (PID namespace and fresh ``/proc``, pids cgroup, the Unix-socket filter) in
interleaved pairs. The address-space column halves the search interval
until it is under 64 MiB: the smallest ``RLIMIT_AS`` under which a child imports each module.

    .venv/bin/python bench/sandbox.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import console, fmt
from rich.table import Table

from artifact_store.inspection import check_upload
from artifact_store.sandbox import Limits, run_sandboxed
from artifact_store.sandbox.forkserver import fork_server
from compiler_worker import sandbox_child
from compiler_worker.benchmark import read_cpu_times, sample_host
from compiler_worker.pipeline import compile_model, plan_build
from compiler_worker.sandbox import Sandbox
from kiln.examples import mlp
from runtime_agent.fingerprint import detect_fingerprint
from schemas._canonical import sha256_hex
from schemas.options import CompileOptions
from services.api.inspection import INSPECTION_CHILD, check_model_upload
from services.config import KilnSettings

MIB = 1 << 20


TICK = os.sysconf("SC_CLK_TCK")


def _time(fn, repeats: int, cpu: list[float] | None = None) -> list[float]:
    """Wall seconds per call; the CPU seconds the host spent outside this process meanwhile
    (the child and what serves it) go to ``cpu``."""
    samples = []
    for _ in range(repeats):
        before = read_cpu_times()
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
        after = read_cpu_times()
        if cpu is not None:
            cpu.append(((after.busy - before.busy) - (after.own - before.own)) / TICK)
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
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    settings = KilnSettings(env="dev")
    model = mlp()
    data = model.SerializeToString()
    options = CompileOptions(verify_samples=2, benchmark_iterations=3)
    fingerprint = detect_fingerprint()
    plan = plan_build(sha256_hex(data), options, fingerprint)
    sandboxes = {"forked": Sandbox(Limits(wall_s=600)),
                 "started": Sandbox(Limits(wall_s=600, fork_server=False))}
    quiet = sample_host(2.0)  # the CPU column counts every process but this one

    with tempfile.TemporaryDirectory(prefix="kiln-bench-") as tmp:
        root = Path(tmp)
        upload = root / "model.onnx"
        upload.write_bytes(data)
        counter = iter(range(1_000_000))

        def fresh() -> Path:
            path = root / f"run-{next(counter)}"
            path.mkdir()
            return path

        entries = ("artifact_store.sandbox", INSPECTION_CHILD, sandbox_child.__name__)
        starts = {entry: _time(lambda e=entry: fork_server(e, restart=True), args.repeats)
                  for entry in entries}

        def inspect(how: str) -> None:
            check_model_upload([("model.onnx", upload)], fresh() / "model",
                               settings=settings.model_copy(
                                   update={"sandbox_fork_server": how == "forked"}))

        rows = [
            ("child round trip (no work)", entries[0],
             lambda how: run_sandboxed("artifact_store.sandbox", "noop", {}, scratch=fresh(),
                                       limits=Limits(fork_server=how == "forked"),
                                       stage="bench"), None, args.repeats, 1000, "ms"),
            ("API: inspect a model upload", INSPECTION_CHILD, inspect,
             lambda: check_upload([("model.onnx", upload)], fresh() / "model",
                                  max_bytes=settings.max_upload_bytes), args.repeats, 1000, "ms"),
            ("worker: compile the MLP (tuning)", entries[2],
             lambda how: sandboxes[how].compile_model(data, options, fingerprint=fingerprint,
                                                      workdir=fresh(), plan=plan),
             lambda: compile_model(data, options, fingerprint=fingerprint, workdir=fresh(),
                                   plan=plan), max(1, args.repeats // 2), 1, "s"),
        ]
        table = Table(title="the sandbox's cost (median \\[min–max]; forked and started "
                            "interleaved)")
        for column in ("step", "child", "wall", "CPU outside this process",
                       "in the calling process (wall)"):
            table.add_column(column)
        for name, entry, sandboxed, direct, repeats, unit, suffix in rows:
            walls: dict[str, list[float]] = {"forked": [], "started": []}
            cpus: dict[str, list[float]] = {"forked": [], "started": []}
            for _ in range(repeats):
                for how in walls:
                    walls[how] += _time(lambda how=how, run=sandboxed: run(how), 1,
                                        cpus[how])
            own = fmt(_time(direct, repeats), unit, suffix, 1) if direct else "—"
            digits = 0 if suffix == "ms" else 2
            for how in walls:
                table.add_row(name if how == "forked" else "", how,
                              fmt(walls[how], unit, suffix, digits),
                              fmt(cpus[how], unit, suffix, digits),
                              own if how == "forked" else "")
            table.add_row("", "fork server's start (once per process)",
                          fmt(starts[entry], 1000, "ms", 0), "", "")
        console.print(table)

        bounds = Table(title=f"the process bounds' cost: a bare forked child, {args.repeats * 2} "
                             f"interleaved pairs (median \\[min–max])")
        for column in ("limits", "wall", "CPU outside this process"):
            bounds.add_column(column)
        variants = {"all bounds (default)": Limits(),
                    "no PID namespace, pids cgroup or socket filter":
                        Limits(process_isolation=False, processes=None,
                               unix_socket_isolation=False)}
        walls: dict[str, list[float]] = {name: [] for name in variants}
        cpus: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.repeats * 2):
            for name, limits in variants.items():
                walls[name] += _time(lambda limits=limits: run_sandboxed(
                    "artifact_store.sandbox", "noop", {}, scratch=fresh(), limits=limits,
                    stage="bench"), 1, cpus[name])
        for name in variants:
            bounds.add_row(name, fmt(walls[name], 1000, "ms", 0), fmt(cpus[name], 1000, "ms", 0))
        console.print(bounds)
    console.print(f"before the run, other processes kept {quiet.busy:.0%} of the CPU busy "
                  f"(steal {quiet.steal:.0%}); load average {os.getloadavg()[0]:.2f} at its end "
                  f"(the children above included): a figure taken while something else "
                  f"loaded the cores is not a result")

    space = Table(title="least address space (RLIMIT_AS) to import, within 64 MiB")
    space.add_column("module")
    space.add_column("RLIMIT_AS")
    for module in ("numpy", "onnx", "onnxruntime", "compiler_worker.pipeline", "torch"):
        space.add_row(module, f"{least_address_space(module) // MIB} MiB")
    console.print(space)


if __name__ == "__main__":
    main()

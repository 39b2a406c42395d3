"""One embedded stack's life, as every integration test pays it: ``kiln.stack.EmbeddedStack``
started (``stack-init``, the API up and ready), its worker registered, then stopped; with the
CPU its processes took (every process of the stack is waited for, so the children's rusage
holds all of it). The floor beside it: one bare interpreter started and waited for, in the
same run. What the test suite's wall time is made of, one stack at a time.

    .venv/bin/python bench/stack_cycle.py [--cycles 8]
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import console, fmt, free_port
from rich.table import Table

from compiler_worker.benchmark import read_cpu_times
from kiln.stack import EmbeddedStack
from tests.conftest import migrated_sqlite
from tests.integration.conftest import wait_for_worker


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_cycle(root: Path) -> dict[str, float]:
    home = root / "kiln"
    migrated_sqlite(home / "kiln.db")  # as the tests start theirs: a copy of a migrated file
    stack = EmbeddedStack(home=home, port=free_port(), pool="solo")
    cpu, started = children_cpu(), time.perf_counter()
    stack.start()
    ready = time.perf_counter()
    client = stack.client()
    wait_for_worker(client)
    client.close()
    registered = time.perf_counter()
    stack.stop()
    stopped = time.perf_counter()
    return {"start (API ready)": ready - started, "worker registered": registered - ready,
            "stop": stopped - registered, "whole cycle": stopped - started,
            "CPU of its processes": children_cpu() - cpu}


def bare_interpreter() -> dict[str, float]:
    cpu, started = children_cpu(), time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    return {"whole cycle": time.perf_counter() - started, "CPU of its processes":
            children_cpu() - cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=8)
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    migrated_sqlite(Path(tempfile.mkdtemp()) / "warm" / "kiln.db")  # the template, once
    one_cycle(Path(tempfile.mkdtemp()))  # warm the page cache: imports, wheels' libraries
    stacks: dict[str, list[float]] = {}
    bare: dict[str, list[float]] = {}
    host0, children0 = read_cpu_times(), children_cpu()
    for _ in range(args.cycles):  # interleaved: a drift of the machine's load hits both
        for name, value in one_cycle(Path(tempfile.mkdtemp())).items():
            stacks.setdefault(name, []).append(value)
        for name, value in bare_interpreter().items():
            bare.setdefault(name, []).append(value)
    host1, children1 = read_cpu_times(), children_cpu()
    # Of the whole run, the share other processes kept busy (this one and the stacks it
    # started and waited for subtracted) and the share the hypervisor stole.
    total = host1.total - host0.total
    ours = (host1.own - host0.own) + (children1 - children0) * os.sysconf("SC_CLK_TCK")
    others = max(0.0, (host1.busy - host0.busy) - ours) / total
    stolen = (host1.steal - host0.steal) / total
    table = Table(title=f"embedded stack, {args.cycles} cycles: median \\[min–max]")
    table.add_column("phase")
    table.add_column("stack", justify="right")
    table.add_column("bare interpreter", justify="right")
    table.add_column("stack / bare", justify="right")
    for name, samples in stacks.items():
        floor = bare.get(name)
        table.add_row(name, fmt(samples), fmt(floor) if floor else "",
                      f"{statistics.median(samples) / statistics.median(floor):.0f}×"
                      if floor else "")
    console.print(table)
    console.print(f"other processes kept {others:.0%} of the CPU busy during the run, steal "
                  f"{stolen:.0%}, load average {os.getloadavg()[0]:.2f} at its end: a figure "
                  f"taken while something else loaded the cores is not a result")


if __name__ == "__main__":
    main()

"""Identical onnxruntime sessions timed in one process, in interleaved blocks, with and without
a pause between one session's block and the next's.

The sessions load the same model with the same options, so any difference between their
medians is the measurement's, not the engines'. Without a pause, a session's block starts while
the previous session's worker threads still spin-wait for work, and on a small machine the two
share the cores: the medians then follow the order the sessions ran in. This is why the tuner
(``compiler_worker.benchmark.SPIN_GAP_S``) and ``bench._common.blocks`` wait between two
engines' calls. The table gives each session's median [min-max] per gap, and the spread of the
medians (slowest over fastest): near 1.00 means the order no longer matters.

    .venv/bin/python bench/spin_gap.py                      # a 1024-wide MLP, four sessions
    .venv/bin/python bench/spin_gap.py --sessions 6 --gaps 0,0.01,0.05 --rounds 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from _common import blocks, console, fmt
from rich.table import Table

from compiler_worker.benchmark import sample_host
from kiln.examples import mlp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--gaps", default="0,0.005,0.02,0.05",
                        help="comma-separated pauses between blocks, seconds")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--block", type=int, default=50, help="timed calls per block")
    args = parser.parse_args()

    import numpy as np
    import onnxruntime as ort

    model = mlp(in_features=1024, hidden=1024, out_features=1024, batch=1)
    path = Path(tempfile.mkdtemp(prefix="kiln-spin-gap-")) / "mlp.onnx"
    path.write_bytes(model.SerializeToString())
    feed = {model.graph.input[0].name: np.random.default_rng(0).standard_normal(
        (1, 1024)).astype(np.float32)}
    sessions = [ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
                for _ in range(args.sessions)]
    paths = {f"session {i + 1}": (lambda s=s: s.run(None, feed)) for i, s in enumerate(sessions)}

    host = sample_host(1.0)
    table = Table(title=f"{args.sessions} identical onnxruntime sessions of a 1024-wide MLP, "
                        f"{args.rounds} rounds x {args.block} calls; ms per call")
    table.add_column("gap between blocks")
    for name in paths:
        table.add_column(name)
    table.add_column("slowest / fastest median")
    for gap in (float(g) for g in args.gaps.split(",")):
        samples = blocks(paths, args.rounds, args.block, gap_s=gap)
        medians = [statistics.median(v) for v in samples.values()]
        table.add_row(f"{gap * 1000:g} ms", *(fmt(v, 1000.0, "") for v in samples.values()),
                      f"{max(medians) / min(medians):.2f}")
    console.print(table)
    console.print(f"Host before the run: other processes {host.busy:.0%} of the CPU, steal "
                  f"{host.steal:.0%}, load average {host.loadavg:.2f} on {os.cpu_count()} "
                  f"logical CPUs", markup=False, highlight=False)


if __name__ == "__main__":
    main()

"""ONNX conformance: compile ONNX's own backend test models with Kiln, compare the engines'
outputs with the shipped ones, and print the summary (passed / failed / skipped, and why).

    .venv/bin/python bench/conformance.py [--suite light|pytorch-converted|pytorch-operator|node]
                                          [--node-stride N] [--show-passed]

The cases and how each is judged live in ``tests/conformance/zoo.py`` (the same code the
pytest ``conformance`` test runs).
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.table import Table

from bench._common import console
from tests.conformance import zoo


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", action="append",
                        choices=["light", "pytorch-converted", "pytorch-operator", "node"])
    parser.add_argument("--node-stride", type=int, default=zoo.NODE_STRIDE)
    parser.add_argument("--show-passed", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("compiler_worker").setLevel(logging.CRITICAL)

    import onnxruntime

    from runtime_agent.fingerprint import detect_fingerprint

    onnxruntime.set_default_logger_severity(4)
    suites = args.suite or ["light", "pytorch-converted", "pytorch-operator", "node"]
    cases = []
    for suite in suites:
        if suite == "light":
            cases += list(zoo.light_cases())
        elif suite == "node":
            cases += list(zoo.node_cases(args.node_stride))
        else:
            cases += list(zoo.directory_cases(suite))
    fingerprint = detect_fingerprint()
    started = time.perf_counter()
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="kiln-conformance-") as tmp:
        for case in cases:
            outcomes.append(zoo.run_case(case, fingerprint, Path(tmp)))
    elapsed = time.perf_counter() - started

    counts = Table(title=f"ONNX conformance: {len(outcomes)} models compiled with Kiln "
                         f"(tune=off) in {elapsed:.0f} s")
    for col in ("suite", "models", "passed", "of which on shipped samples", "failed",
                "skipped", "unsupported"):
        counts.add_column(col, justify="left" if col == "suite" else "right")

    def tally(items: list) -> Counter:
        counter = Counter(o.status for o in items)
        counter["samples"] = sum(o.status == "passed" and bool(o.reason) for o in items)
        return counter

    suites_seen = dict.fromkeys(o.case.split("/")[0] for o in outcomes)
    for suite in suites_seen:
        items = [o for o in outcomes if o.case.split("/")[0] == suite]
        c = tally(items)
        counts.add_row(suite, str(len(items)), str(c["passed"]), str(c["samples"]),
                       str(c["failed"]), str(c["skipped"]), str(c["unsupported"]))
    total = tally(outcomes)
    counts.add_row("all", str(len(outcomes)), str(total["passed"]), str(total["samples"]),
                   str(total["failed"]), str(total["skipped"]), str(total["unsupported"]),
                   style="bold")
    console.print(counts)

    reasons = Table(title="Not passed, and why")
    for col in ("model", "status", "reason"):
        reasons.add_column(col, overflow="fold")
    for outcome in outcomes:
        if outcome.status != "passed" or args.show_passed:
            reasons.add_row(outcome.case, outcome.status, outcome.reason)
    console.print(reasons)
    grouped = Counter(re.sub(r"'[^']*'", "'…'", o.reason.split(" (")[0]) for o in outcomes
                      if o.status in ("skipped", "unsupported"))
    skipped = Table(title="Skipped and unsupported, by reason")
    skipped.add_column("reason")
    skipped.add_column("models", justify="right")
    for reason, count in grouped.most_common():
        skipped.add_row(reason, str(count))
    console.print(skipped)
    return 1 if total["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())

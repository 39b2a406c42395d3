"""The one-thread BLAS default (``schemas.blas``) takes effect only if a process sets it before
numpy loads: the worker's and ``kiln``'s entry points set it first. Each is run in a fresh
interpreter without ``OPENBLAS_NUM_THREADS``, stopped just after the point where it must have
set it, and asked what it sees."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Stops ``python -m compiler_worker worker`` where it reads its settings (right after its
#: BLAS default) and says what it sees then.
WORKER = """
import json, os, runpy, sys
import compiler_worker.config as config
def stop():
    print(json.dumps({"blas": os.environ.get("OPENBLAS_NUM_THREADS"),
                      "numpy": "numpy" in sys.modules}))
    raise SystemExit(0)
config.get_worker_settings = stop
sys.argv = ["compiler_worker", "worker", "--pool", "solo"]
runpy.run_module("compiler_worker", run_name="__main__")
"""

#: Stops ``kiln``'s ``main()`` where it hands over to the command line.
KILN = """
import json, os, sys
import kiln.cli
def stop(app, err):
    print(json.dumps({"blas": os.environ.get("OPENBLAS_NUM_THREADS"),
                      "numpy": "numpy" in sys.modules}))
kiln.cli.run_reporting_errors = stop
kiln.cli.main()
"""


@pytest.mark.parametrize("script", [WORKER, KILN], ids=["compiler_worker", "kiln"])
def test_an_entry_point_sets_one_blas_thread_before_numpy_loads(script: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {"blas": "1", "numpy": False}, seen


def test_an_operators_blas_threads_win_at_the_entry_point() -> None:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "3"}
    proc = subprocess.run([sys.executable, "-c", KILN], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["blas"] == "3"

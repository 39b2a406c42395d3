"""``make run``'s main job, ``kiln demo``, as a process on the embedded stack: build a model in
code, compile it on every worker key that takes ONNX, deploy it to a local agent, serve it and
compare with the reference."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_kiln_demo_runs_the_main_job_end_to_end(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    proc = subprocess.run([sys.executable, "-m", "kiln.cli", "demo"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "(exact)" in output and "served vs reference" in output, output[-4000:]
    # The verdict is the last line on stdout (off a terminal, tables' titles and captions go
    # to stderr, so they may come after it in the combined output).
    assert proc.stdout.rstrip().endswith("OK"), output[-4000:]

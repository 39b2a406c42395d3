"""Retune on a new chip variant, on the embedded stack: a node whose fingerprint key the
fleet has never seen registers (here: this machine declared one x86-64 level down through a
fingerprint file), serves a portable fallback at once, and swaps to its own engine once a
worker of its kind (started with the same declaration) has built it.

Reports, per run: registration → first fallback inference, registration → exact engine served,
and how long the node served the fallback. The compile worker for the new variant is started
right after registration (build on device), so the time includes its start.

    .venv/bin/python bench/retune.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import httpx
import numpy as np
from _common import console, fmt, free_port
from rich.table import Table

from kiln.examples import mlp
from kiln.stack import EmbeddedStack
from runtime_agent.executors import node_fingerprint_keys
from runtime_agent.fingerprint import detect_fingerprint, isa_class, older_variant


def one_run(i: int, tmp: Path) -> tuple[float, float, float]:
    fp = older_variant(detect_fingerprint())
    fp_file = tmp / "variant.json"
    fp_file.write_text(fp.model_dump_json())
    agent_port = free_port()
    stack = EmbeddedStack(home=tmp / "kiln", port=free_port(), pool="solo",
                          overrides={"KILN_AGENT_HEARTBEAT_S": "0.5"})
    agent = None
    try:
        stack.start()
        client = stack.client()
        while not client.live_fingerprint_keys():
            time.sleep(0.1)
        model = client.upload_model(mlp(seed=500 + i).SerializeToString())
        client.deploy("svc", model.id, selector={})
        x = io.BytesIO()
        np.savez(x, x=np.zeros((1, 64), np.float32))
        argv = [sys.executable, "-m", "kiln.cli", "agent", "--api", stack.api_url,
                "--token", stack.token, "--name", "new-variant", "--port", str(agent_port),
                "--cache-dir", str(tmp / "cache"), "--fingerprint-file", str(fp_file),
                "--root-key", str(stack.home / "root.key.pub")]
        agent = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 env={**os.environ, "KILN_AGENT_HEARTBEAT_S": "0.5"})
        while True:
            try:
                registered = datetime.fromisoformat(
                    client.get_agent("new-variant")["registered_at"]).timestamp()
                break
            except Exception:
                time.sleep(0.02)
        stack.add_worker("worker-variant", pool="solo", fingerprint_file=str(fp_file))
        first_fallback = exact = None
        with httpx.Client(timeout=10) as http:
            deadline = time.monotonic() + 300
            while exact is None and time.monotonic() < deadline:
                try:
                    r = http.post(f"http://127.0.0.1:{agent_port}/v1/models/svc/infer",
                                  content=x.getvalue(),
                                  headers={"Content-Type": "application/x-npz"})
                    tier = {m["name"]: m["tier"] for m in
                            http.get(f"http://127.0.0.1:{agent_port}/v1/models").json()}
                except httpx.TransportError:
                    time.sleep(0.02)
                    continue
                now = time.time()
                if r.status_code == 200 and tier.get("svc") == "fallback" and not first_fallback:
                    first_fallback = now
                if r.status_code == 200 and tier.get("svc") == "exact":
                    exact = now
                time.sleep(0.01)
        if first_fallback is None or exact is None:
            raise RuntimeError(f"run {i}: fallback {first_fallback}, exact {exact}")
        return first_fallback - registered, exact - registered, exact - first_fallback
    finally:
        if agent is not None:
            agent.terminate()
            agent.wait(20)
        stack.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs = []
    for i in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            runs.append(one_run(i, Path(tmp)))
    declared = isa_class(older_variant(detect_fingerprint()).cpu)
    table = Table(title=f"new chip variant (declared {declared}) joining, {args.repeats} runs, "
                        "median \\[min–max]; heartbeat 0.5 s")
    table.add_column("interval")
    table.add_column("time")
    for label, column in (("registration → first inference on the fallback", 0),
                          ("registration → exact engine served", 1),
                          ("served the fallback for", 2)):
        table.add_row(label, fmt([r[column] for r in runs]))
    console.print(table)
    here = node_fingerprint_keys(detect_fingerprint())["onnxruntime"]
    console.print(f"this machine: {here}")


if __name__ == "__main__":
    main()

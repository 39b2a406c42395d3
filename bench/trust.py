"""What signed metadata costs: signing a desired state in the API and checking it in the
agent (signature over the exact bytes, schema, version, expiry), and checking a stored
manifest, each against parsing the same bytes with pydantic alone, measured in the same run.

    .venv/bin/python bench/trust.py [--models 10] [--repeats 2000]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from _common import console
from rich.table import Table

from artifact_store.signing import Verifier, generate_keypair
from runtime_agent.trust import AgentTrust
from schemas.agents import DesiredModel, DesiredState
from services.signer import OnlineSigner
from tests.artifact_store.conftest import build_manifest


def per_call_us(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - start) / 1000)
    return statistics.median(samples), statistics.quantiles(samples, n=10)[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        key = generate_keypair(Path(tmp) / "online.key")
        signer = OnlineSigner(Path(tmp) / "online.key")
        state = DesiredState(agent="node-1", heartbeat_s=5.0, models=[
            DesiredModel(deployment=f"d{i}", deployment_id=f"id{i}", generation=1,
                         model_id="a" * 64, options_digest="b" * 64, backend="onnxruntime",
                         fingerprint_key="ort-cpu-x86-64-v3-ort1.32", artifact_id=f"art{i}",
                         tier="exact") for i in range(args.models)])
        trust = AgentTrust(Path(tmp) / "agent", root_keys=[], agent="node-1",
                           trusted_keys=[Path(tmp) / "online.key.pub"])
        envelopes = [signer.sign_desired_state(state, ttl_s=300) for _ in range(args.repeats)]
        plain = state.model_dump_json().encode()
        manifest = build_manifest([])
        stored = key.sign_manifest(manifest)
        verifier = Verifier([key.public_pem()])
        next_envelope = iter(envelopes)

        rows = [
            ("sign a desired state (API)",
             per_call_us(lambda: signer.sign_desired_state(state, ttl_s=300), args.repeats)),
            ("check a desired state (agent; writes its trust record)",
             per_call_us(lambda: trust.verify(next(next_envelope), None), args.repeats)),
            ("peer: parse the same desired state, unsigned",
             per_call_us(lambda: DesiredState.model_validate_json(plain), args.repeats)),
            ("check a stored manifest", per_call_us(
                lambda: verifier.verify_manifest(stored), args.repeats)),
            ("peer: parse the same manifest, unsigned", per_call_us(
                lambda: type(manifest).model_validate_json(manifest.unsigned_bytes()),
                args.repeats)),
        ]
    table = Table(title=f"signed metadata, {args.models} models per desired state, "
                        f"{args.repeats} calls each")
    for column in ("operation", "median µs", "p90 µs"):
        table.add_column(column, justify="left" if column == "operation" else "right")
    for name, (median, p90) in rows:
        table.add_row(name, f"{median:.1f}", f"{p90:.1f}")
    console.print(table)


if __name__ == "__main__":
    main()

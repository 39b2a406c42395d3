"""The variant matrix as a table: one embedded stack (API + one worker on this machine), an
fp32, an int8 and a bf16 engine built here for real, and one ``kiln agent`` per declared chip
variant (this machine as it is, without VNNI, without AVX-512 BF16 and AMX, another core-count
class, one x86-64 level down, aarch64), each registering with its fingerprint file.

Per variant x precision: the artifact the agent serves and at which tier, whether the
engine's signed requirements hold on the variant (the unmet ones named), whether the control
plane refused the engine for it, which build it queued (a retune for the node's own tuning
context, or a build for its own key) and whether the served agent's inference matched the
reference. A precision this CPU cannot build for real is left out, with the reason.
``tests/integration/test_variant_matrix.py`` asserts on the same matrix.

    .venv/bin/python bench/variants.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from _common import console, free_port
from rich.table import Table

from kiln.examples import mlp
from kiln.stack import EmbeddedStack
from runtime_agent.executors import node_fingerprint_keys
from runtime_agent.fingerprint import detect_fingerprint
from tests.integration.agents import reference
from tests.integration.variants import (
    ENGINES,
    LABELS,
    X,
    build_engines,
    not_buildable_here,
    observe,
    settle,
    start_agents,
    wait_registered,
    write_fingerprints,
)


def main() -> None:
    here = detect_fingerprint()
    skipped = {p: why for p in ENGINES if (why := not_buildable_here(p, here.cpu))}
    precisions = [p for p in ENGINES if p not in skipped]
    if not precisions:
        raise SystemExit(f"this CPU builds none of the matrix's engines: {skipped}")
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        stack = EmbeddedStack(home=workdir / "kiln", port=free_port(),
                              pool="solo",
                              overrides={"KILN_AGENT_HEARTBEAT_S": "0.5"})
        agents = {}
        try:
            stack.start()
            client = stack.client()
            while not client.live_fingerprint_keys():
                time.sleep(0.1)
            fingerprints = write_fingerprints(workdir)
            model = mlp(seed=27).SerializeToString()
            model_id = client.upload_model(model).id
            started = time.perf_counter()
            engines = build_engines(client, model_id, precisions)
            built_s = time.perf_counter() - started
            for precision in precisions:
                client.deploy(precision, model_id, selector=dict([LABELS.split("=")]),
                              options=ENGINES[precision])
            started = time.perf_counter()
            agents = start_agents(stack, workdir, list(fingerprints))
            wait_registered(client, agents)
            states = settle(stack, client, model_id, agents, precisions, timeout_s=150,
                            strict=False)
            settled_s = time.perf_counter() - started
            cells = observe(stack, client, engines, fingerprints, agents, states,
                            reference(model, X))
        finally:
            for agent in agents.values():
                agent.kill()
            stack.stop()

    table = Table(title="variant x engine precision, one worker on this machine "
                        f"({here.cpu.model}, {here.cpu.cores} cores)")
    for column in ("variant", "precision", "artifact", "tier", "requirements on the variant",
                   "refused", "queued", "inference", "notes"):
        table.add_column(column, overflow="fold")
    served_unmet = 0
    for cell in cells:
        artifact = (cell.artifact_id or "-")[:12]
        if cell.artifact_id and not cell.built_here:
            artifact += f" ({cell.backend}, another build)"
        if cell.tier in ("exact", "compatible") and cell.served_unmet:
            served_unmet += 1
        table.add_row(cell.variant, cell.precision, artifact, cell.tier,
                      "met" if not cell.unmet else "unmet: " + "; ".join(cell.unmet),
                      "yes" if cell.refused else "-", cell.queued,
                      {None: "-", True: "matches", False: "WRONG"}[cell.inferred],
                      "; ".join(cell.notes))
    console.print(table)
    for precision, why in skipped.items():
        console.print(f"{precision}: not built on this CPU ({why})")
    keys = node_fingerprint_keys(here)
    console.print(f"this machine: {keys.get('onnxruntime')}, {keys.get('openvino')}; engines "
                  f"built in {built_s:.1f} s; {len(cells) // len(precisions)} agents registered "
                  f"and settled in {settled_s:.1f} s")
    console.print(f"engines served at exact or compatible to a variant lacking a requirement: "
                  f"{served_unmet}")
    print(f"\n`{' '.join(['.venv/bin/python bench/variants.py', *sys.argv[1:]])}`")


if __name__ == "__main__":
    main()

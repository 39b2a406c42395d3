"""Kiln's SDK in a few calls: compile a model for the fleet, then serve it.

    kiln up --agent site=a          # in another shell (or point KILN_API_URL/KILN_TOKEN at an API)
    python examples/sdk_quickstart.py [MODEL.onnx] [--selector site=a]

Without MODEL.onnx it compiles a small MLP built in code. The API and token come from
KILN_API_URL and KILN_TOKEN, else from the client.json that `kiln up` writes under KILN_HOME.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import kiln


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", type=Path, help="an .onnx file (default: an MLP)")
    parser.add_argument("--precision", default="auto", help="fp32, auto, fp16, bf16 or int8")
    parser.add_argument("--selector", default=None,
                        help="deploy to the agents with this label key=value (default: don't)")
    parser.add_argument("--name", default="quickstart", help="the deployment's name")
    args = parser.parse_args(argv)

    model = args.model
    if model is None:
        from kiln.examples import mlp

        model = Path(tempfile.mkdtemp()) / "mlp.onnx"
        model.write_bytes(mlp(seed=1).SerializeToString())

    with kiln.Client() as client:
        job = client.submit(model, precision=args.precision)
        artifact = job.wait()
        sys.stdout.write(f"artifact {artifact.artifact_id}: {artifact.backend} for "
                         f"{artifact.fingerprint_key}, verified max abs error "
                         f"{artifact.verification.max_abs_error:.3g}, build-host p50 "
                         f"{artifact.benchmark.p50_ms:.3f} ms\n")
        if args.selector:
            key, _, value = args.selector.partition("=")
            deployment = client.deploy(args.name, job.model.id, selector={key: value})
            for agent in deployment.wait():
                sys.stdout.write(f"agent {agent.agent} serves {args.name}: artifact "
                                 f"{agent.artifact_id} ({agent.tier})\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

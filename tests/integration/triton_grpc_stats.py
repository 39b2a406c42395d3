"""Run by ``test_batching.py`` in a child process (tritonclient's gRPC module and the agent's
generated code both define ``inference.*`` in protobuf's one pool): Triton's ModelConfig and
ModelStatistics over gRPC, printed as JSON.

    python triton_grpc_stats.py HOST:PORT MODEL
"""

from __future__ import annotations

import json
import sys

import tritonclient.grpc as grpcclient


def main(url: str, model: str) -> None:
    client = grpcclient.InferenceServerClient(url)
    report = {"config": client.get_model_config(model, as_json=True)["config"],
              "stats": client.get_inference_statistics(model, as_json=True)}
    print(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:3])

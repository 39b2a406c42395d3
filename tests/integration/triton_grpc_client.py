"""tritonclient.grpc, unmodified, against an agent: run as a child process by
``test_oip.py`` (tritonclient's generated protocol messages and the agent's own cannot share
one process's protobuf pool).

``python triton_grpc_client.py URL TOKEN MODEL INPUT_NPZ OUTPUT_NPZ``: writes the outputs and
a JSON report of what the server answered to stdout.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException


def main(url: str, token: str, model: str, input_path: str, output_path: str) -> None:
    client = grpcclient.InferenceServerClient(url)
    auth = {"authorization": f"Bearer {token}"}
    report: dict = {"live": client.is_server_live(), "ready": client.is_server_ready()}
    report["model_ready"] = client.is_model_ready(model, headers=auth)
    metadata = client.get_model_metadata(model, headers=auth, as_json=True)
    report["metadata"] = metadata
    with np.load(input_path) as data:
        feed = {name: data[name] for name in data.files}
    inputs = []
    for tensor in metadata["inputs"]:
        value = feed[tensor["name"]]
        inputs.append(grpcclient.InferInput(tensor["name"], list(value.shape),
                                            tensor["datatype"]))
        inputs[-1].set_data_from_numpy(value)
    result = client.infer(model, inputs, headers=auth)
    np.savez(output_path, **{t["name"]: result.as_numpy(t["name"])
                             for t in metadata["outputs"]})

    errors = {}
    wrong = grpcclient.InferInput(metadata["inputs"][0]["name"], [1, 2], "FP64")
    wrong.set_data_from_numpy(np.zeros((1, 2), np.float64))
    for case, call in (("datatype", lambda: client.infer(model, [wrong], headers=auth)),
                       ("model", lambda: client.infer("nope", inputs, headers=auth)),
                       ("token", lambda: client.infer(model, inputs))):
        try:
            call()
            errors[case] = None
        except InferenceServerException as exc:
            errors[case] = {"status": exc.status(), "message": exc.message()}
    report["errors"] = errors
    report["after_errors"] = client.infer(model, inputs, headers=auth).as_numpy(
        metadata["outputs"][0]["name"]).shape
    json.dump(report, sys.stdout, default=list)


if __name__ == "__main__":
    main(*sys.argv[1:])

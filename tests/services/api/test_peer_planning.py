"""Planning a deployment across a node's backends: a backend whose candidates race in another
backend's job on the worker (OpenVINO beside onnxruntime) is planned a job of its own only when
the deployment names it; the client's default targets leave its key out the same way."""

from __future__ import annotations

from datetime import UTC, datetime

from runtime_agent.executors import peer_backends
from schemas.deployments import Deployment
from schemas.options import CompileOptions
from services.api.fleet import AgentProfile, choose_backends

KEYS = {"onnxruntime": "ort-cpu-x86-64-v4-ort1.32",
        "openvino": "ov-cpu-x86-64-v4-amx-bf16-vnni-ov2026.4.1",
        "aotinductor": "aoti-cpu-x86-64-v4-torch2.13"}


def deployment(**options) -> Deployment:
    now = datetime.now(UTC)
    chosen = CompileOptions(**options)
    return Deployment(id="d", name="svc", model_id="m", options=chosen,
                      options_digest=chosen.digest(), selector={}, generation=1,
                      created_at=now, updated_at=now)


def test_openvino_is_planned_only_when_named() -> None:
    assert "openvino" in peer_backends()
    agent = AgentProfile(labels={}, fingerprint_keys=dict(KEYS), compatibility_keys={})
    every = choose_backends(deployment(), agent, takes=lambda key: True,
                            builds=lambda key: True)
    assert ("openvino", KEYS["openvino"]) not in every
    assert every[0] == ("onnxruntime", KEYS["onnxruntime"])
    # Other backends the worker builds the format on are still planned (a torch program's
    # AOTInductor engine beside onnxruntime's).
    assert ("aotinductor", KEYS["aotinductor"]) in every
    named = choose_backends(deployment(backends=["openvino"]), agent, takes=lambda key: True,
                            builds=lambda key: True)
    assert named == [("openvino", KEYS["openvino"])]
    both = choose_backends(deployment(backends=["onnxruntime", "openvino"]), agent,
                           takes=lambda key: True, builds=lambda key: True)
    assert both == [("onnxruntime", KEYS["onnxruntime"]), ("openvino", KEYS["openvino"])]


def test_iree_is_planned_beside_another_backend_only_when_named() -> None:
    """IREE's builds are long and its engines lose on a node that has onnxruntime: a
    deployment naming no backend queues none beside onnxruntime's, but a node whose only
    backend is IREE (an arm64 edge node) is planned for it."""
    assert "iree" in peer_backends()
    keys = {**KEYS, "iree": "iree-cpu-x86-64-v4-iree3.13"}
    agent = AgentProfile(labels={}, fingerprint_keys=keys, compatibility_keys={})
    every = choose_backends(deployment(), agent, takes=lambda key: True,
                            builds=lambda key: True)
    assert ("iree", keys["iree"]) not in every
    named = choose_backends(deployment(backends=["onnxruntime", "iree"]), agent,
                            takes=lambda key: True, builds=lambda key: True)
    assert ("iree", keys["iree"]) in named
    edge = AgentProfile(labels={}, fingerprint_keys={"iree": "iree-cpu-armv8-iree3.13"},
                        compatibility_keys={})
    assert choose_backends(deployment(), edge, takes=lambda key: True,
                           builds=lambda key: True) == [("iree", "iree-cpu-armv8-iree3.13")]

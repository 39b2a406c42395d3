"""The keys a request targets when it names none: every key live workers serve for the model's
format, except a backend's whose candidates race in another backend's job on that worker
(OpenVINO beside onnxruntime), unless the request names that backend."""

from __future__ import annotations

from typing import Any

from kiln.client import KilnClient
from runtime_agent.executors import node_fingerprint_keys
from schemas.fingerprint import CpuInfo, HardwareFingerprint, RuntimeVersions

V4 = ["ssse3", "sse4_1", "sse4_2", "popcnt", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2",
      "avx512f", "avx512cd", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni"]
FINGERPRINT = HardwareFingerprint(cpu=CpuInfo(arch="x86_64", features=V4),
                                  runtimes=RuntimeVersions(onnxruntime="1.32.0",
                                                           openvino="2026.4.1"))


class ListedWorkers(KilnClient):
    """The client with ``GET /v1/workers`` answered from a list: the method under test only
    reads that list, so no API needs to run for it."""

    def __init__(self, workers: list[dict[str, Any]]) -> None:
        super().__init__("http://127.0.0.1:9", None)
        self.workers = workers

    def list_workers(self) -> list[dict[str, Any]]:
        return self.workers


def test_the_openvino_key_is_a_target_only_when_named() -> None:
    keys = node_fingerprint_keys(FINGERPRINT)
    ort, ov = keys["onnxruntime"], keys["openvino"]
    client = ListedWorkers([{
        "alive": True, "fingerprint_keys": [ort, ov],
        "model_formats": {ort: ["onnx"], ov: ["onnx"]},
        "fingerprint": FINGERPRINT.model_dump(mode="json")}])
    assert client.live_fingerprint_keys("onnx") == [ort]
    assert client.live_fingerprint_keys("onnx", backends=["openvino"]) == sorted([ort, ov])


def test_a_workers_tuning_context_key_is_no_default_target() -> None:
    """A worker also consumes its own tuning context's key (``K-t-…``): only a node of that
    context needs an engine there, so a request naming no key does not build one."""
    ort = node_fingerprint_keys(FINGERPRINT)["onnxruntime"]
    client = ListedWorkers([{
        "alive": True, "fingerprint_keys": [ort, f"{ort}-t-c1-4"],
        "model_formats": {ort: ["onnx"]}, "fingerprint": FINGERPRINT.model_dump(mode="json")}])
    assert client.live_fingerprint_keys("onnx") == [ort]

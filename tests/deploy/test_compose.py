"""docker-compose.yml: every long-running service restarts, every image is pinned, and the GPU
worker is built from the Dockerfile's GPU target."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
ONE_SHOT = {"minio-init"}


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_every_service_restarts() -> None:
    for name, service in _compose()["services"].items():
        wanted = {"on-failure"} if name in ONE_SHOT else {"always", "unless-stopped"}
        assert service.get("restart") in wanted, f"{name}: restart {service.get('restart')!r}"


def _pinned(image: str) -> bool:
    _, _, tag = image.rpartition(":")
    if "/" in tag or not tag or tag == "latest":
        return False
    # A dated release (minio) or at least major.minor (postgres 16.6, redis 7.4).
    return bool(re.fullmatch(r"RELEASE\.\d{4}-\d\d-\d\dT[\d-]+Z|\d+\.\d+(\.\d+)?(-[\w.-]+)?",
                             tag))


def test_no_image_is_unpinned() -> None:
    for name, service in _compose()["services"].items():
        if "image" in service:
            assert _pinned(service["image"]), f"{name}: image {service['image']} is not pinned"
        else:
            assert "build" in service, name
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("FROM "):
            image = line.split()[1]
            if image.startswith("${"):
                default = re.search(r"ARG CUDA_IMAGE=(\S+)", (ROOT / "Dockerfile").read_text())
                image = default.group(1)
            assert _pinned(image), f"Dockerfile: {image} is not pinned"


def test_gpu_worker_builds_the_gpu_image() -> None:
    services = _compose()["services"]
    gpu = services["worker-gpu"]["build"]
    assert gpu["target"] == "gpu" and "gpu" in gpu["args"]["KILN_EXTRAS"].split(",")
    for name in ("api", "worker-cpu", "agent"):
        assert services[name]["build"]["target"] == "cpu", name
    dockerfile = (ROOT / "Dockerfile").read_text()
    stage = dockerfile.split(" AS gpu", 1)[1].split("\nFROM ", 1)[0]
    assert "onnxruntime-gpu" in stage and "python3.11" in stage
    assert re.search(r"ARG CUDA_IMAGE=nvidia/cuda:[\d.]+-\S*runtime-ubuntu22\.04", dockerfile)

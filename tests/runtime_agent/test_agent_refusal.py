"""An agent given an OpenVINO engine that its OpenVINO refuses to import reports the refusal,
typed and naming the artifact, in a heartbeat at once, and serves the next engine it is given.

The engine is real: ``mlp`` built by the OpenVINO backend on this machine, its blob's header
then made to record another OpenVINO release (the bytes a blob of that release carries),
signed again as the control plane would. OpenVINO itself refuses the import; nothing is
mocked. What the control plane does with the refusal is tested against the real API
(``tests/services/api/test_refused_artifacts.py``); here the stub answers as it does."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from compiler_worker.pipeline import compile_model, write_artifact_dir
from kiln.examples import mlp
from runtime_agent.agent import Agent
from runtime_agent.config import AgentSettings
from runtime_agent.executors import MANIFEST_FILENAME, blob_filename
from runtime_agent.executors.openvino.executor import OpenVinoExecutor
from runtime_agent.fingerprint import detect_fingerprint
from schemas.agents import ModelState
from schemas.options import CompileOptions
from tests.runtime_agent.helpers import (
    TOKEN,
    ControlPlaneStub,
    Fixtures,
    desired_model,
    free_port,
    read_manifest,
    wait_for,
)

pytest.importorskip("openvino")


def openvino_artifact(directory: Path, built: Fixtures) -> Path:
    result = compile_model(mlp().SerializeToString(),
                           CompileOptions(verify_samples=2, benchmark_iterations=3, tune="off",
                                          backends=["openvino"]),
                           fingerprint=detect_fingerprint(), workdir=directory / "work")
    assert result.manifest.backend == "openvino"
    return write_artifact_dir(result, directory / "out",
                              built.keys.signer.sign_manifest(result.manifest))


def of_another_release(template: Path, out: Path, built: Fixtures) -> Path:
    """``template`` with its blob's header recording another OpenVINO release (same length,
    so the header's length field holds), re-signed under a new id."""
    manifest = read_manifest(template)
    shutil.copytree(template, out)
    (ref,) = [b for b in manifest.blobs if b.name == "engine"]
    path = out / blob_filename(ref)
    version = OpenVinoExecutor.probe_version() or ""
    blob = path.read_bytes()
    forged = blob.replace(f"ov={version}".encode(), f"ov={'9' * len(version)}".encode(), 1)
    assert forged != blob
    path.unlink()
    fixed = ref.model_copy(update={"sha256": hashlib.sha256(forged).hexdigest()})
    (out / blob_filename(fixed)).write_bytes(forged)
    manifest = manifest.model_copy(update={
        "artifact_id": "ov-of-another-release", "signature": None,
        "blobs": [fixed if b.name == "engine" else b for b in manifest.blobs]})
    (out / MANIFEST_FILENAME).write_bytes(built.keys.signer.sign_manifest(manifest))
    return out


def test_a_refused_blob_is_reported_typed_at_once_and_the_next_engine_serves(
        tmp_path: Path, control_plane: ControlPlaneStub, built: Fixtures,
        monkeypatch: pytest.MonkeyPatch) -> None:
    good = openvino_artifact(tmp_path / "ov", built)
    refused = control_plane.add(of_another_release(good, tmp_path / "forged", built))
    fallback = control_plane.add(built.mlp_a)
    # The stub answers as the control plane does (services/api/fleet.py): once the agent
    # reports the refusal, the next engine.
    issue = control_plane.issue

    def answer(name: str, **kwargs):
        if any(r.artifact_id == refused for beat in control_plane.heartbeats[-1:]
               for m in beat.models for r in m.refused):
            kwargs.setdefault("models", [desired_model("mlp", fallback)])
        return issue(name, **kwargs)

    monkeypatch.setattr(control_plane, "issue", answer)
    # Heartbeats far apart: the refusal, and the answer to it, must not wait for the next.
    control_plane.heartbeat_s = 60.0
    settings = AgentSettings(api_url=control_plane.url, token=TOKEN, name="node-1",
                             cache_dir=tmp_path / "cache", serve_port=free_port(),
                             trusted_keys=[built.keys.public], heartbeat_s=60.0,
                             request_timeout_s=5)
    control_plane.desired = [desired_model("mlp", refused)]
    with Agent(settings) as agent:
        wait_for(lambda: (s := control_plane.last_status("mlp")) is not None and s.refused,
                 timeout_s=30, what="the refusal in a heartbeat")
        beat = next(b for b in control_plane.heartbeats if b.models and b.models[0].refused)
        status = beat.models[0]
        assert status.state is ModelState.FAILED and status.target_artifact_id == refused
        assert status.error is not None and status.error.code == "fingerprint_mismatch"
        (refusal,) = status.refused
        assert refusal.artifact_id == refused and refusal.code == "fingerprint_mismatch"
        assert "refuses the compiled blob" in refusal.message
        assert refusal.fingerprint_keys == agent.fingerprint_keys

        wait_for(lambda: agent.models.find("mlp") is not None
                 and agent.models.find("mlp").artifact_id == fallback,
                 timeout_s=30, what="the next engine serving")

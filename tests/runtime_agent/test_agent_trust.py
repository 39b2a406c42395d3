"""Signed desired state against a real agent process (``kiln agent``).

The control plane here is the stub of ``helpers`` over real HTTP, playing an attacker who
controls the network (or the control plane): it replays an older desired state, serves an
expired one, swaps the model, signs with a key the agent does not trust, or names another
agent. Each is refused, and the agent keeps serving the engine it has. The agent trusts a
root key only (as TUF): it learns the online key from root metadata, and follows a rotation.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import numpy as np
import pytest

from artifact_store.signing import Signer, generate_keypair, new_root_metadata, resign
from runtime_agent.executors import MANIFEST_FILENAME
from schemas.agents import ModelState
from tests.runtime_agent.helpers import (
    TOKEN,
    ControlPlaneStub,
    Fixtures,
    desired_model,
    fake_artifact,
    free_port,
    read_manifest,
    wait_for,
)

X = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
YEAR = timedelta(days=365)


class AgentProc:
    """``kiln agent`` as a process, provisioned with the root public key only."""

    def __init__(self, stub: ControlPlaneStub, root_pub: Path, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [sys.executable, "-m", "kiln.cli", "agent", "--api", stub.url, "--token",
                     TOKEN, "--name", "node-1", "--port", str(self.port), "--cache-dir",
                     str(workdir / "cache"), "--root-key", str(root_pub)]
        self.log = workdir / "agent.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> AgentProc:
        env = {**os.environ, "KILN_ENV": "dev", "KILN_HOME": str(self.log.parent / "home")}
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def infer(self) -> str:
        """The artifact that answers an inference request now."""
        response = httpx.post(f"{self.url}/v1/models/mlp/infer",
                              json={"inputs": {"x": X.tolist()}}, timeout=10)
        assert response.status_code == 200, response.text
        return response.json()["artifact_id"]

    def healthz(self) -> dict:
        return httpx.get(f"{self.url}/healthz", timeout=5).json()


@pytest.fixture
def trust(control_plane: ControlPlaneStub, built: Fixtures, tmp_path: Path) -> Signer:
    """Root metadata version 1 naming the online key the stub signs with; the root key."""
    root = generate_keypair(tmp_path / "root" / "root.key")
    control_plane.roots.append(new_root_metadata(root, [built.keys.signer.key], version=1,
                                                 expires_in=YEAR))
    control_plane.heartbeat_s = 0.2
    return root


@pytest.fixture
def agent(control_plane: ControlPlaneStub, trust: Signer, tmp_path: Path) -> Iterator[AgentProc]:
    proc = AgentProc(control_plane, tmp_path / "root" / "root.key.pub", tmp_path)
    try:
        yield proc
    finally:
        proc.stop()
    assert b"Traceback" not in proc.log.read_bytes(), proc.log.read_text()


def serving(stub: ControlPlaneStub, agent: AgentProc, artifact_id: str):
    def check() -> bool:
        assert agent.alive(), agent.log.read_text()
        status = stub.last_status("mlp")
        return (status is not None and status.state == ModelState.SERVING
                and status.artifact_id == artifact_id)
    return check


def refused(stub: ControlPlaneStub, reason_or_code: str):
    """The agent's heartbeat reports that the last desired state was refused so."""
    def check() -> bool:
        beat = stub.heartbeats[-1] if stub.heartbeats else None
        error = beat.trust.refused if beat and beat.trust else None
        return error is not None and reason_or_code in (error.code.value,
                                                        error.details.get("reason"))
    return check


def start_serving_a(stub: ControlPlaneStub, agent: AgentProc, built: Fixtures) -> str:
    a = stub.add(built.mlp_a)
    stub.desired = [desired_model("mlp", a)]
    agent.start()
    wait_for(serving(stub, agent, a), timeout_s=60, what="the agent serving a")
    assert agent.infer() == a
    return a


def still_serving(stub: ControlPlaneStub, agent: AgentProc, artifact_id: str) -> None:
    """A few more heartbeats answered with the refused state change nothing."""
    seen = len(stub.heartbeats)
    wait_for(lambda: len(stub.heartbeats) >= seen + 3, timeout_s=20, what="more heartbeats")
    assert agent.infer() == artifact_id
    assert stub.last_status("mlp").artifact_id == artifact_id


def test_a_replayed_older_version_is_refused_also_after_a_restart(
        control_plane: ControlPlaneStub, agent: AgentProc, built: Fixtures) -> None:
    a = start_serving_a(control_plane, agent, built)
    old = control_plane.issued[-1]  # signed, genuine, and naming a
    b = control_plane.add(built.mlp_b)
    control_plane.desired = [desired_model("mlp", b)]
    wait_for(serving(control_plane, agent, b), timeout_s=60, what="the agent serving b")

    control_plane.serve_instead = old
    wait_for(refused(control_plane, "rollback"), timeout_s=20, what="the replay refused")
    still_serving(control_plane, agent, b)
    assert agent.healthz()["trust"]["refused"]["details"]["reason"] == "rollback"

    # The highest version seen survives a restart: the replay is still refused, and the
    # agent serves b from its persisted (newer) state.
    agent.stop()
    control_plane.heartbeats.clear()
    agent.start()
    wait_for(serving(control_plane, agent, b), timeout_s=60, what="b served after a restart")
    wait_for(refused(control_plane, "rollback"), timeout_s=20,
             what="the replay refused after a restart")
    still_serving(control_plane, agent, b)

    # Even without the persisted desired state, the trust record remembers the version.
    agent.stop()
    (agent.log.parent / "cache" / "state.json").unlink()
    control_plane.heartbeats.clear()
    agent.start()
    wait_for(refused(control_plane, "rollback"), timeout_s=60,
             what="the replay refused with no persisted state")
    seen = len(control_plane.heartbeats)
    wait_for(lambda: len(control_plane.heartbeats) >= seen + 3, timeout_s=30, what="beats")
    assert agent.healthz()["models"] == [] and a != b  # a was never loaded again


def test_an_expired_desired_state_is_refused_and_the_agent_reports_itself_stale(
        control_plane: ControlPlaneStub, agent: AgentProc, built: Fixtures) -> None:
    control_plane.expires_in_s = 3.0
    a = start_serving_a(control_plane, agent, built)
    b = control_plane.add(built.mlp_b)
    control_plane.serve_instead = control_plane.issue(
        "node-1", models=[desired_model("mlp", b)], expires_in_s=-1)

    wait_for(refused(control_plane, "expired"), timeout_s=20, what="the expired state refused")
    # What it accepted last expires too: it keeps serving a, and says it is stale.
    wait_for(lambda: agent.healthz()["status"] == "stale", timeout_s=20, what="stale")
    wait_for(lambda: control_plane.heartbeats[-1].trust.stale, timeout_s=20,
             what="a stale heartbeat")
    still_serving(control_plane, agent, a)

    control_plane.serve_instead = None  # fresh metadata again: no longer stale
    control_plane.expires_in_s = 300.0
    wait_for(lambda: agent.healthz()["status"] == "ok", timeout_s=20, what="fresh again")


def test_a_swapped_model_is_refused(
        control_plane: ControlPlaneStub, agent: AgentProc, built: Fixtures) -> None:
    a = start_serving_a(control_plane, agent, built)
    b = control_plane.add(built.mlp_b)
    # Signed by the trusted key, but the artifact is an engine of another model than the
    # one the deployment names (model B served under deployment A's model).
    model_a = read_manifest(built.mlp_a).model_sha256
    control_plane.desired = [desired_model("mlp", b, model_id=model_a)]

    def failed() -> bool:
        status = control_plane.last_status("mlp")
        return status.state == ModelState.FAILED and status.error is not None
    wait_for(failed, timeout_s=20, what="the swap refused")
    status = control_plane.last_status("mlp")
    assert status.error.code == "metadata_refused"
    assert status.error.details["reason"] == "model_mismatch"
    still_serving(control_plane, agent, a)


def test_metadata_or_a_manifest_signed_by_an_untrusted_key_is_refused(
        control_plane: ControlPlaneStub, agent: AgentProc, built: Fixtures,
        tmp_path: Path) -> None:
    a = start_serving_a(control_plane, agent, built)
    b = control_plane.add(built.mlp_b)
    control_plane.serve_instead = control_plane.issue(
        "node-1", models=[desired_model("mlp", b)], signer=built.untrusted.signer)
    wait_for(refused(control_plane, "signature_invalid"), timeout_s=20,
             what="the forged state refused")
    still_serving(control_plane, agent, a)

    # Genuine desired state, naming an artifact whose manifest an untrusted key signed.
    forged = control_plane.add(fake_artifact(built.mlp_b, tmp_path / "forged", "forged1",
                                             (built.mlp_b / "engine.onnx").read_bytes(),
                                             built.untrusted.signer))
    control_plane.serve_instead = None
    control_plane.desired = [desired_model("mlp", forged)]

    def failed() -> bool:
        status = control_plane.last_status("mlp")
        return (status.state == ModelState.FAILED and status.error is not None
                and status.target_artifact_id == forged)
    wait_for(failed, timeout_s=20, what="the forged manifest refused")
    assert control_plane.last_status("mlp").error.code == "signature_invalid"
    still_serving(control_plane, agent, a)


def test_desired_state_for_another_agent_is_refused(
        control_plane: ControlPlaneStub, agent: AgentProc, built: Fixtures) -> None:
    a = start_serving_a(control_plane, agent, built)
    b = control_plane.add(built.mlp_b)
    control_plane.serve_instead = control_plane.issue(
        "node-1", models=[desired_model("mlp", b)], agent="node-2")
    wait_for(refused(control_plane, "wrong_agent"), timeout_s=20, what="refused")
    still_serving(control_plane, agent, a)


def resigned_copy(artifact_dir: Path, out: Path, signers: list[Signer]) -> Path:
    shutil.copytree(artifact_dir, out)
    manifest = out / MANIFEST_FILENAME
    manifest.write_bytes(resign(manifest.read_bytes(), signers))
    return out


def test_online_key_rotation_is_followed_and_the_old_key_refused(
        control_plane: ControlPlaneStub, agent: AgentProc, built: Fixtures, trust: Signer,
        tmp_path: Path) -> None:
    a = start_serving_a(control_plane, agent, built)
    assert control_plane.heartbeats[-1].trust.root_version == 1
    old = built.keys.signer
    new = generate_keypair(tmp_path / "new" / "online.key")

    # The rotation: root metadata version 2, signed by the root key, names only the new key;
    # the artifacts are re-signed by it; the control plane signs with it from now on.
    control_plane.roots.append(new_root_metadata(trust, [new.key], version=2,
                                                 expires_in=YEAR))
    b = control_plane.add(resigned_copy(built.mlp_b, tmp_path / "b-new", [new]))
    control_plane.signer = new
    control_plane.desired = [desired_model("mlp", b)]
    wait_for(serving(control_plane, agent, b), timeout_s=60,
             what="the agent following the new key to b")
    wait_for(lambda: control_plane.heartbeats[-1].trust.root_version == 2, timeout_s=20,
             what="root version 2 reported")
    assert json.loads((tmp_path / "cache" / "trust" / "root.json").read_bytes())[
        "signed"]["version"] == 2

    # After the rotation, whatever the old key signs is refused, however new its version.
    control_plane.serve_instead = control_plane.issue(
        "node-1", models=[desired_model("mlp", a)], signer=old)
    wait_for(refused(control_plane, "signature_invalid"), timeout_s=20,
             what="the old key refused")
    still_serving(control_plane, agent, b)

    # Root metadata that the root key did not sign is not followed either.
    rogue = generate_keypair(tmp_path / "rogue" / "root.key")
    control_plane.roots.append(new_root_metadata(rogue, [old.key], version=3,
                                                 expires_in=YEAR))
    seen = len(control_plane.heartbeats)
    wait_for(lambda: len(control_plane.heartbeats) >= seen + 3, timeout_s=20, what="beats")
    assert control_plane.heartbeats[-1].trust.root_version == 2
    assert control_plane.heartbeats[-1].trust.refused.code.value == "signature_invalid"
    still_serving(control_plane, agent, b)


def issued_before(stub: ControlPlaneStub, models, *, seconds_ago: float) -> bytes:
    """A genuine desired state for node-1 issued ``seconds_ago`` (still unexpired): what
    an attacker who recorded the traffic, or the old cache, would hold."""
    from datetime import UTC, datetime

    from artifact_store.signing import DESIRED_STATE_PAYLOAD_TYPE
    from schemas._canonical import canonical_json
    from schemas.agents import DesiredState

    issued = datetime.now(UTC) - timedelta(seconds=seconds_ago)
    state = DesiredState(agent="node-1", models=models, heartbeat_s=stub.heartbeat_s,
                         version=int(issued.timestamp() * 1_000_000), issued_at=issued,
                         expires=issued + timedelta(seconds=300))
    return stub.signer.sign_envelope(canonical_json(state), DESIRED_STATE_PAYLOAD_TYPE)


def test_a_wiped_state_folder_does_not_let_an_older_desired_state_back_in(
        control_plane: ControlPlaneStub, agent: AgentProc, built: Fixtures) -> None:
    """The trust record is gone with the folder, so the agent cannot compare versions: it
    acts on no persisted state, takes no state issued before it started, and once the
    control plane's current state arrives, refuses any older one by version."""
    a = start_serving_a(control_plane, agent, built)
    agent.stop()
    old = issued_before(control_plane, [desired_model("mlp", a)], seconds_ago=90)
    b = control_plane.add(built.mlp_b)
    control_plane.desired = [desired_model("mlp", b)]

    cache = agent.log.parent / "cache"
    shutil.rmtree(cache)
    cache.mkdir()
    (cache / "state.json").write_bytes(old)  # planted where the persisted state lives ...
    control_plane.serve_instead = old  # ... and replayed over the network
    control_plane.heartbeats.clear()
    agent.start()
    wait_for(refused(control_plane, "rollback"), timeout_s=60,
             what="the older state refused by an agent with a wiped folder")
    seen = len(control_plane.heartbeats)
    wait_for(lambda: len(control_plane.heartbeats) >= seen + 3, timeout_s=30, what="beats")
    assert agent.healthz()["models"] == []  # a was not served again
    assert "trust record" in agent.log.read_text()

    # The control plane's current state sets the floor; the replay is refused by version.
    control_plane.serve_instead = None
    wait_for(serving(control_plane, agent, b), timeout_s=60, what="b served")
    control_plane.serve_instead = old
    control_plane.heartbeats.clear()
    wait_for(refused(control_plane, "rollback"), timeout_s=20, what="the replay refused")
    still_serving(control_plane, agent, b)


def test_with_no_trust_record_a_persisted_state_waits_for_the_control_plane(
        control_plane: ControlPlaneStub, agent: AgentProc, built: Fixtures) -> None:
    """Even a state issued moments ago is not taken from the folder while the trust record is
    missing: the control plane (unreachable here) must answer first. The agent pins the online
    key (with a root key, a wiped folder also lost the root metadata, and nothing verifies
    before the control plane answers anyway)."""
    a = control_plane.add(built.mlp_a)
    cache = agent.log.parent / "cache"
    cache.mkdir()
    (cache / "state.json").write_bytes(
        issued_before(control_plane, [desired_model("mlp", a)], seconds_ago=1))
    agent.argv[agent.argv.index("--api") + 1] = f"http://127.0.0.1:{free_port()}"
    at = agent.argv.index("--root-key")
    agent.argv[at:at + 2] = ["--trusted-key", str(built.keys.public)]
    agent.start()
    wait_for(lambda: b"agent node-1 started" in agent.log.read_bytes(), timeout_s=30,
             what="the agent starting")
    trust = agent.healthz()["trust"]
    assert trust["desired_version"] is None, trust
    assert "waiting for the control plane" in agent.log.read_text()
    assert not (cache / "trust" / "state.json").exists()

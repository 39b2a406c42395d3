"""The agent daemon in-process, against the control-plane stub over real HTTP."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

from runtime_agent.agent import Agent
from runtime_agent.config import AgentSettings, parse_labels
from runtime_agent.executors import node_compatibility_keys, node_fingerprint_keys
from runtime_agent.fingerprint import detect_fingerprint
from runtime_agent.server import ServerThread
from schemas.agents import ModelState
from schemas.errors import ConfigError
from schemas.fingerprint import CpuInfo
from tests.runtime_agent.helpers import (
    TOKEN,
    ControlPlaneStub,
    Fixtures,
    desired_model,
    fake_artifact,
    free_port,
    wait_for,
)

X = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)


@pytest.fixture
def settings(tmp_path: Path, control_plane: ControlPlaneStub, built: Fixtures) -> AgentSettings:
    return AgentSettings(
        api_url=control_plane.url, token=TOKEN, name="node-1", labels={"zone": "a"},
        cache_dir=tmp_path / "cache", serve_port=free_port(), trusted_keys=[built.keys.public],
        heartbeat_s=0.05, request_timeout_s=5,
    )


def infer(agent: Agent) -> str:
    response = httpx.post(f"{agent.settings.serve_url}/v1/models/mlp/infer",
                          json={"inputs": {"x": X.tolist()}}, timeout=5)
    assert response.status_code == 200, response.text
    return response.json()["artifact_id"]


def status_is(stub: ControlPlaneStub, state: ModelState, artifact_id: str | None):
    def check() -> bool:
        status = stub.last_status("mlp")
        return status is not None and status.state == state and status.artifact_id == artifact_id
    return check


def test_registers_serves_swaps_and_keeps_the_old_engine_on_failure(
        settings: AgentSettings, control_plane: ControlPlaneStub, built: Fixtures,
        tmp_path: Path) -> None:
    a, b = control_plane.add(built.mlp_a), control_plane.add(built.mlp_b)
    broken = control_plane.add(fake_artifact(built.mlp_a, tmp_path / "broken", "broken1",
                                             b"not an onnx model", built.keys.signer))
    control_plane.desired = [desired_model("mlp", a)]
    with Agent(settings) as agent:
        wait_for(status_is(control_plane, ModelState.SERVING, a), what="serving a")
        [registration] = control_plane.registrations
        assert registration.name == "node-1" and registration.labels == {"zone": "a"}
        assert registration.fingerprint_keys == node_fingerprint_keys(detect_fingerprint())
        assert registration.compatibility_keys == node_compatibility_keys(detect_fingerprint())
        assert registration.compatibility_keys["onnxruntime"][0].startswith("ort-cpu-")
        assert registration.serve_url == f"http://127.0.0.1:{settings.serve_port}"
        assert infer(agent) == a

        control_plane.desired = [desired_model("mlp", b)]
        wait_for(status_is(control_plane, ModelState.SERVING, b), what="serving b")
        assert infer(agent) == b
        status = control_plane.last_status("mlp")
        assert status.requests == 0 and status.target_artifact_id is None

        control_plane.desired = [desired_model("mlp", broken)]
        wait_for(status_is(control_plane, ModelState.FAILED, b), what="failed, b serving")
        status = control_plane.last_status("mlp")
        assert status.target_artifact_id == broken
        assert status.error.code == "backend_unavailable" and "could not load" in \
            status.error.message
        assert infer(agent) == b
        wait_for(lambda: control_plane.last_status("mlp").requests == 1, what="requests")
        assert control_plane.last_status("mlp").p50_ms > 0

        control_plane.desired = []
        wait_for(lambda: agent.models.names() == [], what="unloaded")
        assert agent.cache.is_pinned(a) is False and agent.cache.is_pinned(b) is False


def test_refuses_untrusted_and_incompatible_artifacts(
        settings: AgentSettings, control_plane: ControlPlaneStub, built: Fixtures,
        tmp_path: Path) -> None:
    untrusted = control_plane.add(fake_artifact(
        built.mlp_a, tmp_path / "u", "untrusted1", b"whatever", built.untrusted.signer))
    control_plane.desired = [desired_model("mlp", untrusted)]
    with Agent(settings) as agent:
        wait_for(status_is(control_plane, ModelState.FAILED, None), what="signature failure")
        error = control_plane.last_status("mlp").error
        assert error.code == "signature_invalid" and "not trusted" in error.message
        assert agent.models.names() == []

    # A node whose CPU lacks the ISA the (level-3) engine was built for.
    fingerprint = detect_fingerprint()
    older = fingerprint.model_copy(update={"cpu": CpuInfo(arch=fingerprint.cpu.arch)})
    control_plane.heartbeats.clear()
    control_plane.desired = [desired_model("mlp", control_plane.add(built.mlp_a))]
    with Agent(settings, fingerprint=older):
        wait_for(status_is(control_plane, ModelState.FAILED, None), what="fingerprint refusal")
        error = control_plane.last_status("mlp").error
        # The signed requirements are checked before the engine loads, and say what is missing.
        assert error.code == "fingerprint_mismatch"
        assert "requires ISA level" in error.message and "which this node lacks" in \
            error.message


def test_serves_from_cache_offline_and_catches_up(
        settings: AgentSettings, control_plane: ControlPlaneStub, built: Fixtures) -> None:
    a, b = control_plane.add(built.mlp_a), control_plane.add(built.mlp_b)
    control_plane.desired = [desired_model("mlp", a)]
    with Agent(settings) as agent:
        wait_for(status_is(control_plane, ModelState.SERVING, a), what="serving a")

    # Restarted with its control plane gone: the persisted desired state, from the cache.
    port = free_port()
    offline = settings.model_copy(update={"api_url": f"http://127.0.0.1:{port}"})
    with Agent(offline) as agent:
        wait_for(lambda: agent.models.names() == ["mlp"], what="serving from cache")
        assert infer(agent) == a and not agent.registered.is_set()

        # The control plane comes back (on the same address) with a new desired state.
        control_plane.registrations.clear()
        control_plane.desired = [desired_model("mlp", b)]
        server = ServerThread(control_plane.app(), "127.0.0.1", port)
        server.start()
        try:
            wait_for(lambda: agent.registered.is_set() and infer(agent) == b, what="catch up")
        finally:
            server.stop()


def test_re_registers_when_the_control_plane_forgot_it(
        settings: AgentSettings, control_plane: ControlPlaneStub) -> None:
    with Agent(settings):
        wait_for(lambda: len(control_plane.heartbeats) >= 2, what="heartbeats")
        control_plane.registrations.clear()
        wait_for(lambda: len(control_plane.registrations) == 1, what="registering again")


def test_refuses_to_start_without_a_trusted_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no trusted key is configured"):
        Agent(AgentSettings(cache_dir=tmp_path, serve_port=0))


def test_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_AGENT_LABELS", "zone=a, gpu=h100")
    monkeypatch.setenv("KILN_AGENT_TRUSTED_KEYS", "/k/a.pub,/k/b.pub")
    monkeypatch.setenv("KILN_AGENT_SERVE_PORT", "0")
    settings = AgentSettings()
    assert settings.labels == {"zone": "a", "gpu": "h100"}
    assert [str(p) for p in settings.trusted_keys] == ["/k/a.pub", "/k/b.pub"]
    assert settings.serve_url is None
    assert parse_labels('{"a": "b"}') == {"a": "b"}
    with pytest.raises(ConfigError, match="must be written key=value"):
        parse_labels("zone")
    with pytest.raises(ConfigError, match="label key"):
        parse_labels("bad key=1")


def test_the_serve_token_reaches_the_inference_server(settings: AgentSettings) -> None:
    from fastapi.testclient import TestClient
    from pydantic import SecretStr

    guarded = Agent(settings.model_copy(update={"serve_token": SecretStr("t0ken")}))
    client = TestClient(guarded.app)
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer t0ken"}).status_code == 200

    # Beyond loopback without a token is refused at start-up (HTTP or gRPC alike); with one,
    # or with no server at all, it starts.
    other = settings.cache_dir.with_name("other")
    for ports in ({"serve_port": 8100}, {"serve_port": 0, "grpc_port": 8101}):
        with pytest.raises(ConfigError, match="KILN_AGENT_SERVE_TOKEN"):
            Agent(settings.model_copy(update={"serve_host": "0.0.0.0", "cache_dir": other,
                                              **ports}))
    Agent(settings.model_copy(update={"serve_host": "0.0.0.0", "cache_dir": other,
                                      "serve_token": SecretStr("t0ken")}))
    Agent(settings.model_copy(update={"serve_host": "0.0.0.0", "serve_port": 0, "grpc_port": 0,
                                      "cache_dir": other.with_name("third")}))


def test_without_the_long_poll_route_heartbeats_bring_the_state_and_it_is_logged_once(
        settings: AgentSettings, control_plane: ControlPlaneStub, built: Fixtures,
        caplog: pytest.LogCaptureFixture) -> None:
    """The stub is an older control plane: it has no ``/desired-state`` route (a plain 404)."""
    a, b = control_plane.add(built.mlp_a), control_plane.add(built.mlp_b)
    control_plane.desired = [desired_model("mlp", a)]
    with caplog.at_level("WARNING", logger="runtime_agent.agent"), Agent(settings) as agent:
        wait_for(status_is(control_plane, ModelState.SERVING, a), what="serving a")
        control_plane.desired = [desired_model("mlp", b)]
        wait_for(status_is(control_plane, ModelState.SERVING, b), what="serving b by heartbeat")
        beats = len(control_plane.heartbeats)
        wait_for(lambda: len(control_plane.heartbeats) > beats + 5, what="more heartbeats")
        assert not agent.long_polling.is_set()
    missing = [r for r in caplog.records if "no long-poll of the desired state" in r.message]
    assert len(missing) == 1

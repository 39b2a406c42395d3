"""The agent with artifacts that need custom-op plugins, against the control-plane stub over
real HTTP: bundles fetched, verified and cached by digest, loaded before the engine; an
artifact whose plugin cannot run here refused with a typed error while the old one serves."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import pytest

from artifact_store.signing import load_verifier
from runtime_agent.agent import Agent
from runtime_agent.cache import ArtifactCache
from runtime_agent.config import AgentSettings
from runtime_agent.control import ControlPlane
from schemas.agents import ModelState
from schemas.errors import IntegrityError
from tests.plugins.helpers import (
    ExampleBundles,
    PluginArtifacts,
    derive_artifact,
    models,
    read_manifest,
    rebundle,
)
from tests.runtime_agent.helpers import (
    TOKEN,
    ControlPlaneStub,
    Fixtures,
    desired_model,
    free_port,
    wait_for,
)

IMAGES = np.random.default_rng(5).standard_normal((1, 3, 32, 32)).astype(np.float32)
MATRIX = np.random.default_rng(6).standard_normal((4, 4)).astype(np.float32)


@pytest.fixture
def settings(tmp_path: Path, control_plane: ControlPlaneStub, built: Fixtures) -> AgentSettings:
    return AgentSettings(
        api_url=control_plane.url, token=TOKEN, name="node-plugins", cache_dir=tmp_path / "cache",
        serve_port=free_port(), trusted_keys=[built.keys.public], heartbeat_s=0.05,
        request_timeout_s=10,
    )


def infer(agent: Agent, deployment: str, inputs: dict[str, np.ndarray]) -> tuple[str, dict]:
    response = httpx.post(f"{agent.settings.serve_url}/v1/models/{deployment}/infer",
                          json={"inputs": {k: v.tolist() for k, v in inputs.items()}}, timeout=10)
    assert response.status_code == 200, response.text
    body = response.json()
    return body["artifact_id"], {k: np.asarray(v, np.float32) for k, v in body["outputs"].items()}


def failure(stub: ControlPlaneStub, deployment: str, serving: str):
    """Wait for a heartbeat reporting ``deployment`` failed while ``serving`` serves; its
    error (retries follow quickly, so the state is caught as it is reported)."""
    seen = []

    def check() -> bool:
        for beat in reversed(stub.heartbeats):
            for found in beat.models:
                if (found.deployment == deployment and found.state == ModelState.FAILED
                        and found.artifact_id == serving):
                    seen.append(found.error)
                    return True
        return False

    wait_for(check, what=f"{deployment} refused")
    return seen[0]


def status(stub: ControlPlaneStub, deployment: str, state: ModelState, artifact_id: str | None):
    def check() -> bool:
        found = stub.last_status(deployment)
        return found is not None and found.state == state and found.artifact_id == artifact_id
    return check


def test_serves_models_with_plugins_and_refuses_plugins_that_cannot_run_here(
        settings: AgentSettings, control_plane: ControlPlaneStub, built: Fixtures,
        plugin_artifacts: PluginArtifacts, example_bundles: ExampleBundles,
        tmp_path: Path) -> None:
    cnn, inv = control_plane.add(plugin_artifacts.swish), control_plane.add(
        plugin_artifacts.inverse)
    swish_ref = read_manifest(plugin_artifacts.swish).plugins[0]
    control_plane.desired = [desired_model("cnn", cnn), desired_model("inv", inv)]
    with Agent(settings) as agent:
        wait_for(status(control_plane, "cnn", ModelState.SERVING, cnn), what="cnn serving")
        wait_for(status(control_plane, "inv", ModelState.SERVING, inv), what="inv serving")
        served, outputs = infer(agent, "cnn", {"image": IMAGES})
        builtin = ort.InferenceSession(models.swish_cnn(builtin=True).SerializeToString(),
                                       providers=["CPUExecutionProvider"])
        assert served == cnn
        np.testing.assert_allclose(outputs["probs"], builtin.run(None, {"image": IMAGES})[0],
                                   rtol=1e-4, atol=1e-6)
        served, outputs = infer(agent, "inv", {"a": MATRIX})
        np.testing.assert_allclose(outputs["y"], 2 * np.linalg.inv(MATRIX + 4 * np.eye(4)),
                                   rtol=1e-4, atol=1e-5)
        assert sorted(control_plane.bundle_requests) == [("ortx-inverse", "0.15.2"),
                                                         ("swish", "1.0.0")]
        plugins_dir = agent.cache.plugins_dir
        assert (plugins_dir / f"{swish_ref.digest}.tar").is_file()
        assert (plugins_dir / swish_ref.digest / "swish.py").is_file()

        # A version of the swish plugin with a kernel for the GPU only.
        gpu_only = rebundle(example_bundles.swish, tmp_path, lambda m: (
            m["implementations"][0].update(device="cuda"), m.update(version="1.1.0-gpu")))
        cnn_gpu = control_plane.add(derive_artifact(
            plugin_artifacts.swish, tmp_path / "cnn-gpu", "cnngpu1", example_bundles.swish,
            gpu_only, built.keys.signer))
        # A version of the Inverse plugin whose library needs a newer onnxruntime C API.
        future = rebundle(example_bundles.inverse, tmp_path, lambda m: (
            m["implementations"][0].update(abi=m["implementations"][0]["abi"].replace(
                "-11", "-999")), m.update(version="99.0.0")))
        inv_future = control_plane.add(derive_artifact(
            plugin_artifacts.inverse, tmp_path / "inv-future", "invfuture1",
            example_bundles.inverse, future, built.keys.signer))
        control_plane.desired = [desired_model("cnn", cnn_gpu), desired_model("inv", inv_future)]
        error = failure(control_plane, "cnn", cnn)
        assert error.code == "plugin_error"
        assert ("op kiln.examples::Swish has no implementation for backend 'onnxruntime' on "
                "device 'cpu' in plugin swish 1.1.0-gpu; it has implementations for "
                "['onnxruntime/cuda', 'torch/cpu', 'torch/cuda']") in error.message
        error = failure(control_plane, "inv", inv)
        assert error.code == "plugin_error" and "ort-api-999, but this runtime is" in \
            error.message
        assert infer(agent, "cnn", {"image": IMAGES})[0] == cnn  # the old engine serves
        assert infer(agent, "inv", {"a": MATRIX})[0] == inv

    # Restarted: the bundles come from the cache (by digest), not the control plane again.
    control_plane.desired = [desired_model("cnn", cnn)]
    control_plane.bundle_requests.clear()
    with Agent(settings) as agent:
        wait_for(status(control_plane, "cnn", ModelState.SERVING, cnn), what="cnn again")
        assert infer(agent, "cnn", {"image": IMAGES})[0] == cnn
        assert control_plane.bundle_requests == []


def test_a_bundle_the_control_plane_serves_under_another_digest_is_refused(
        control_plane: ControlPlaneStub, plugin_artifacts: PluginArtifacts,
        example_bundles: ExampleBundles, tmp_path: Path) -> None:
    ref = read_manifest(plugin_artifacts.swish).plugins[0]
    other = rebundle(example_bundles.swish, tmp_path, lambda m: m.update(description="x"))
    control_plane.plugins[(ref.name, ref.version)] = other.archive
    with ControlPlane(control_plane.url, TOKEN) as client, pytest.raises(
            IntegrityError, match=rf"plugin swish 1.0.0 has sha256 {other.ref.digest}; the "
                                  rf"artifact needs {ref.digest}"):
        client.plugin_bundle(ref, tmp_path / "bundle.tar")
    assert not (tmp_path / "bundle.tar").exists()
    control_plane.plugins[(ref.name, ref.version)] = example_bundles.swish.archive
    with ControlPlane(control_plane.url, TOKEN) as client:
        path = client.plugin_bundle(ref, tmp_path / "bundle.tar")
    assert path.read_bytes() == example_bundles.swish.archive.read_bytes()


def test_the_cache_keeps_bundles_by_digest_while_an_artifact_names_them(
        control_plane: ControlPlaneStub, plugin_artifacts: PluginArtifacts,
        built: Fixtures, tmp_path: Path) -> None:
    artifact_id = control_plane.add(plugin_artifacts.swish)
    ref = read_manifest(plugin_artifacts.swish).plugins[0]
    with ArtifactCache(tmp_path / "cache", 10**9) as cache, \
            ControlPlane(control_plane.url, TOKEN) as client:
        cache.fetch(artifact_id, client, load_verifier([built.keys.public]))
        archive = cache.plugin_bundle(ref, client)
        assert archive == cache.plugins_dir / f"{ref.digest}.tar"
        assert cache.plugin_bundle(ref, client) == archive
        assert control_plane.bundle_requests == [("swish", "1.0.0")]
        archive.write_bytes(b"damaged")  # a damaged copy is downloaded again
        assert cache.plugin_bundle(ref, client).read_bytes() == \
            (plugin_artifacts.swish / "plugins" / f"{ref.digest}.tar").read_bytes()
        assert len(control_plane.bundle_requests) == 2
        (cache.plugins_dir / ref.digest).mkdir()
        assert cache.prune_plugins() == []  # the cached artifact names it
        cache.drop(artifact_id)
        cache.evict()
        assert list(cache.plugins_dir.iterdir()) == []

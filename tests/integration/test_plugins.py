"""Custom-op plugins end to end on the embedded stack: push the example bundles, compile
models that use them on a real worker, and serve them through a real agent process."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from schemas.errors import KilnError
from schemas.jobs import JobStatus
from tests.integration.agents import AgentProcess, outputs, reference
from tests.integration.conftest import UNTUNED, wait_for_worker
from tests.integration.test_agent import kiln_cli

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "plugins"


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"kiln_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> dict[str, Path]:
    return _example("build").build(tmp_path_factory.mktemp("bundles"), pack=True)


def test_custom_ops_compile_ship_and_serve_through_an_agent(stack, bundles, tmp_path):
    models = _example("models")
    client = stack.client()
    keys = wait_for_worker(client)

    # A model whose custom op nobody registered fails its job with a typed reason.
    cnn = models.swish_cnn().SerializeToString()
    cnn_id = client.upload_model(cnn).id
    (job,) = client.create_jobs(cnn_id, keys, UNTUNED)
    job = client.wait_job(job.id, timeout_s=120)
    assert job.status is JobStatus.FAILED and job.error.code == "unknown_operator"
    assert "kiln.examples::Swish" in job.error.message

    for archive in bundles.values():
        assert "registered" in kiln_cli(stack, "plugin", "push", str(archive))
    assert "kiln.examples::Swish" in kiln_cli(stack, "plugins")

    inverse = models.inverse_model().SerializeToString()
    client.deploy("swish-cnn", cnn_id, selector={"site": "a"}, options=UNTUNED)
    client.deploy("inverse", client.upload_model(inverse).id, selector={"site": "a"},
                  options=UNTUNED)
    agent = AgentProcess(stack, "n1", "site=a", tmp_path).start()
    try:
        agent.wait_serving("swish-cnn", timeout_s=180)
        agent.wait_serving("inverse", timeout_s=180)
        manifest = client.get_manifest(agent.models()["swish-cnn"]["artifact_id"])
        assert [p.name for p in manifest.plugins] == ["swish"]
        assert manifest.verification.passed

        x = {"image": np.random.default_rng(0).normal(size=(2, 3, 32, 32)).astype(np.float32)}
        want = reference(models.swish_cnn(builtin=True).SerializeToString(), x)["probs"]
        np.testing.assert_allclose(outputs(agent.infer("swish-cnn", x))["probs"], want,
                                   rtol=1e-4, atol=1e-5)
        a = {"a": np.random.default_rng(1).normal(size=(4, 4)).astype(np.float32)}
        want = 2 * np.linalg.inv(a["a"] + 4 * np.eye(4, dtype=np.float32))
        np.testing.assert_allclose(outputs(agent.infer("inverse", a))["y"], want,
                                   rtol=1e-4, atol=1e-5)
    finally:
        agent.kill()


def test_bad_bundles_are_refused_by_the_api(stack, tmp_path):
    client = stack.client()
    evil = tmp_path / "evil.tar"
    import io
    import tarfile

    with tarfile.open(evil, "w") as tar:
        info = tarfile.TarInfo("../../etc/evil.py")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(KilnError) as err:
        client.push_plugin(evil)
    assert err.value.code == "invalid_request" and "escapes" in err.value.message
    assert client.list_plugins() == []

"""``kiln.runtime.load`` of artifacts with custom ops: the bundles in ``plugins/`` are verified
and loaded before the engine."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from kiln import runtime
from runtime_agent.executors import load_executor
from schemas.errors import BackendUnavailable, IntegrityError, NotFound
from tests.plugins.helpers import PluginArtifacts, models, read_manifest
from tests.runtime_agent.helpers import Fixtures

IMAGES = np.random.default_rng(3).standard_normal((2, 3, 32, 32)).astype(np.float32)


def test_the_swish_cnn_runs_with_its_python_kernel(plugin_artifacts: PluginArtifacts,
                                                   built: Fixtures, tmp_path: Path) -> None:
    model = runtime.load(plugin_artifacts.swish, trusted_keys=[built.keys.public],
                         plugin_dir=tmp_path)
    assert [p.name for p in model.manifest.plugins] == ["swish"]
    digest = model.manifest.plugins[0].digest
    assert (tmp_path / digest / "swish.py").is_file()
    builtin = ort.InferenceSession(models.swish_cnn(builtin=True).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(model.run({"image": IMAGES})["probs"],
                               builtin.run(None, {"image": IMAGES})[0], rtol=1e-4, atol=1e-6)


def test_the_inverse_model_runs_with_the_native_library(
        plugin_artifacts: PluginArtifacts) -> None:
    model = runtime.load(plugin_artifacts.inverse)
    a = np.random.default_rng(4).standard_normal((4, 4)).astype(np.float32)
    np.testing.assert_allclose(model.run({"a": a})["y"], 2 * np.linalg.inv(a + 4 * np.eye(4)),
                               rtol=1e-4, atol=1e-5)


def test_a_missing_or_tampered_bundle_is_refused(plugin_artifacts: PluginArtifacts,
                                                 tmp_path: Path) -> None:
    copy = Path(shutil.copytree(plugin_artifacts.swish, tmp_path / "artifact"))
    [bundle] = (copy / "plugins").iterdir()
    data = bytearray(bundle.read_bytes())
    data[-600] ^= 0xFF
    bundle.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=r"plugin bundle .*\.tar has sha256 .*; expected"):
        runtime.load(copy, plugin_dir=tmp_path / "p")
    bundle.unlink()
    with pytest.raises(NotFound, match=r"needs plugin swish 1.0.0 \([0-9a-f]{64}\); its bundle "
                                       r"is not here"):
        runtime.load(copy, plugin_dir=tmp_path / "p")


def test_an_executor_without_its_plugins_refuses_to_load(
        plugin_artifacts: PluginArtifacts) -> None:
    manifest = read_manifest(plugin_artifacts.swish)
    with pytest.raises(BackendUnavailable, match=r"needs plugins \['swish 1.0.0 \(.*\)'\], "
                                                 r"which were not loaded; loaded: none"):
        load_executor(plugin_artifacts.swish, manifest)

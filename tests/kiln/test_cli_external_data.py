"""``kiln compile`` of a model saved with external data, and of a ``torch.onnx.export``."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from kiln import runtime
from kiln.cli import app
from kiln.model_files import model_blob
from schemas.manifest import ArtifactManifest
from tests.models.external_data import external_cnn, with_location

runner = CliRunner()


def test_compile_picks_up_the_data_files_beside_the_model(tmp_path: Path) -> None:
    model = external_cnn(tmp_path / "src")
    out = tmp_path / "artifact"
    result = runner.invoke(app, ["compile", str(model), "--out", str(out), "--options",
                                 _fast_options(tmp_path)])
    assert result.exit_code == 0, result.output
    manifest = ArtifactManifest.model_validate_json((out / "manifest.json").read_text())
    blob = model_blob(model, tmp_path / "blob").read_bytes()
    assert manifest.model_sha256 == hashlib.sha256(blob).hexdigest()
    assert manifest.verification.passed
    y = runtime.load(out).run({"image": np.zeros((1, 3, 32, 32), np.float32)})["probs"]
    assert y.shape == (1, 10)


def test_compile_refuses_a_location_outside_the_model_dir(tmp_path: Path) -> None:
    model = external_cnn(tmp_path / "src")
    bad = model.parent / "bad.onnx"
    bad.write_bytes(with_location(model, "../../etc/passwd"))
    result = runner.invoke(app, ["compile", str(bad), "--out", str(tmp_path / "a")])
    assert result.exit_code != 0
    assert "not a relative path confined" in str(result.output) + str(result.exception)
    assert not (tmp_path / "a").exists()


def _fast_options(tmp_path: Path) -> str:
    path = tmp_path / "options.json"
    path.write_text('{"tune": "off", "verify_samples": 1, "benchmark_iterations": 2}')
    return str(path)


def test_torch_onnx_export_defaults_compile_end_to_end(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed (the dev extra has it)")

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
            self.fc = torch.nn.Linear(8, 4)

        def forward(self, x):
            return self.fc(torch.relu(self.conv(x)).mean(dim=(2, 3)))

    torch.manual_seed(0)
    net = Net().eval()
    path = tmp_path / "export" / "net.onnx"
    path.parent.mkdir()
    x = torch.randn(1, 3, 16, 16)
    torch.onnx.export(net, (x,), str(path))  # the defaults: weights as external data
    files = sorted(p.name for p in path.parent.iterdir())
    assert files == ["net.onnx", "net.onnx.data"], files
    out = tmp_path / "artifact"
    result = runner.invoke(app, ["compile", str(path), "--out", str(out), "--options",
                                 _fast_options(tmp_path)])
    assert result.exit_code == 0, result.output
    loaded = runtime.load(out)
    name = loaded.manifest.inputs[0].name
    got = next(iter(loaded.run({name: x.numpy()}).values()))
    np.testing.assert_allclose(got, net(x).detach().numpy(), rtol=1e-4, atol=1e-5)

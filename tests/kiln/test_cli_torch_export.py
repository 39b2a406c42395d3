"""``kiln submit model.pt2``: a torch.export archive is uploaded as it is and recorded as such."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kiln.cli import app
from kiln.model_files import model_blob, model_files
from tests.kiln.test_cli_datasets import live_api  # noqa: F401 (fixture)
from tests.models.torch_programs import tiny_mlp_archive

runner = CliRunner()
KEY = "aoti-cpu-x86-64-v3-torch2.13"


def test_submit_a_pt2(live_api,  # noqa: F811
                       tmp_path: Path) -> None:
    pt2 = tiny_mlp_archive(tmp_path / "tiny.pt2")
    assert model_files(pt2) == {"tiny.pt2": pt2}
    assert model_blob(pt2, tmp_path / "blob").read_bytes() == pt2.read_bytes()
    result = runner.invoke(app, ["submit", str(pt2), "--target", KEY])
    assert result.exit_code == 0, result.output
    with live_api.client() as client:
        (job,) = client.list_jobs()
        model = client.get_model(job.model_id)
    assert model.id == hashlib.sha256(pt2.read_bytes()).hexdigest()
    assert model.format == "torch-export" and model.name == "tiny"


@pytest.mark.aotinductor
def test_compile_a_pt2_in_process(tmp_path: Path) -> None:
    """``kiln compile model.pt2``: the format picks the AOTInductor backend."""
    import json

    pt2 = tiny_mlp_archive(tmp_path / "tiny.pt2")
    result = runner.invoke(app, ["compile", str(pt2), "--out", str(tmp_path / "artifact"),
                                 "--tune", "off"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "artifact" / "manifest.json").read_text())
    assert "aotinductor" in json.dumps(manifest)
    assert "wrote" in result.output and "aotinductor fp32 for aoti-cpu-" in result.output

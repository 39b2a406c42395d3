"""``kiln run`` and ``kiln agent`` through typer's CliRunner."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from kiln import runtime
from kiln.cli import app
from schemas.errors import ConfigError, InvalidRequest
from tests.runtime_agent.helpers import Fixtures

X = np.random.default_rng(2).standard_normal((2, 64)).astype(np.float32)
runner = CliRunner()


def test_run_writes_the_outputs(built: Fixtures, tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", X)
    out = tmp_path / "out.npz"
    result = runner.invoke(app, ["run", str(built.mlp_a), "--input", f"x={tmp_path / 'x.npy'}",
                                 "--output", str(out), "--trusted-key", str(built.keys.public)])
    assert result.exit_code == 0, result.output
    expected = runtime.load(built.mlp_a).run({"x": X})["y"]
    with np.load(out) as outputs:
        np.testing.assert_array_equal(outputs["y"], expected)


def test_run_takes_an_npz_and_prints_a_summary(built: Fixtures, tmp_path: Path) -> None:
    np.savez(tmp_path / "feed.npz", x=X)
    result = runner.invoke(app, ["run", str(built.mlp_a), "-i", str(tmp_path / "feed.npz")])
    assert result.exit_code == 0, result.output
    assert "float32" in result.output and "[2, 16]" in result.output


def test_run_reports_bad_inputs(built: Fixtures, tmp_path: Path) -> None:
    result = runner.invoke(app, ["run", str(built.mlp_a)])
    assert isinstance(result.exception, InvalidRequest)
    assert "expected inputs [x: float32['N', 64]]" in result.exception.message
    result = runner.invoke(app, ["run", str(built.mlp_a), "-i", f"x={tmp_path / 'none.npy'}"])
    assert result.exit_code == 2 and "cannot read" in result.output


def test_agent_refuses_to_start_without_a_trusted_key(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    result = runner.invoke(app, ["agent", "--port", "0", "--cache-dir", str(tmp_path / "c"),
                                 "--labels", "zone=a"])
    assert isinstance(result.exception, ConfigError)
    assert "no trusted key is configured" in result.exception.message


def test_fingerprint_older_variant_declares_one_level_down(tmp_path: Path) -> None:
    import json

    from runtime_agent.fingerprint import isa_class
    from schemas.fingerprint import HardwareFingerprint

    declared = tmp_path / "v4.json"
    declared.write_text(json.dumps({"cpu": {"arch": "x86_64", "features": [
        "ssse3", "sse4_1", "sse4_2", "popcnt", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2",
        "avx512f", "avx512cd", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni"]}}))
    wide = CliRunner(env={"COLUMNS": "300"})
    result = wide.invoke(app, ["fingerprint", "--fingerprint-file", str(declared),
                               "--older-variant"])
    assert result.exit_code == 0, result.output
    variant = HardwareFingerprint.model_validate_json(result.stdout)  # keys go to stderr
    assert isa_class(variant.cpu) == "x86-64-v3" and variant.source == "declared"

    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps({"cpu": {"arch": "x86_64", "features": []}}))
    refused = wide.invoke(app, ["fingerprint", "--fingerprint-file", str(baseline),
                                "--older-variant"])
    assert refused.exit_code == 2 and "baseline x86-64" in refused.output

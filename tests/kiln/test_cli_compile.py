"""``kiln compile``, ``kiln fingerprint`` and ``kiln token`` from the shell (no services)."""

from __future__ import annotations

import json
from pathlib import Path

import jwt
import numpy as np
from typer.testing import CliRunner

from kiln import runtime
from kiln.cli import app
from kiln.examples import mlp, small_cnn
from schemas.fingerprint import HardwareFingerprint
from schemas.manifest import ArtifactManifest

runner = CliRunner()


def test_compile_writes_an_artifact_dir_that_runs(tmp_path: Path):
    model = tmp_path / "cnn.onnx"
    model.write_bytes(small_cnn().SerializeToString())
    out = tmp_path / "artifact"
    result = runner.invoke(app, ["compile", str(model), "--out", str(out), "--opt-level", "2",
                                 "--tune", "off"])  # tuning has a test of its own below
    assert result.exit_code == 0, result.output
    manifest = ArtifactManifest.model_validate_json((out / "manifest.json").read_text())
    assert manifest.verification.passed and manifest.options.optimization_level == 2
    assert manifest.fingerprint_key in result.output
    loaded = runtime.load(out)
    y = loaded.run({"image": np.zeros((1, 3, 32, 32), np.float32)})["probs"]
    assert y.shape == (1, 10) and np.isclose(y.sum(), 1.0, atol=1e-5)


def test_compile_refuses_what_the_cpu_backend_cannot_build(tmp_path: Path):
    model = tmp_path / "cnn.onnx"
    model.write_bytes(small_cnn().SerializeToString())
    result = runner.invoke(app, ["compile", str(model), "--out", str(tmp_path / "a"),
                                 "--precision", "fp16"])
    assert result.exit_code != 0
    assert not (tmp_path / "a").exists()


def test_fingerprint_prints_json_and_honours_a_declaration(tmp_path: Path):
    detected = runner.invoke(app, ["fingerprint"])
    assert detected.exit_code == 0
    fp = HardwareFingerprint.model_validate_json(detected.stdout)
    assert fp.cpu.arch and fp.runtimes.get("onnxruntime")
    # each installed backend's keys, for `kiln artifacts --fingerprint KEY`, on stderr
    from runtime_agent.executors import node_fingerprint_keys

    assert node_fingerprint_keys(fp)["onnxruntime"] in detected.stderr.replace("\n", "")
    declared = tmp_path / "fp.json"
    declared.write_text(json.dumps({"cpu": {"model": "Simulated CPU"}}))
    result = runner.invoke(app, ["fingerprint", "--fingerprint-file", str(declared)])
    fp = HardwareFingerprint.model_validate_json(result.stdout)
    assert fp.cpu.model == "Simulated CPU" and fp.source == "declared"


def test_token_is_minted_from_the_stack_secret(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("KILN_SECRET_KEY", raising=False)
    missing = runner.invoke(app, ["token", "--home", str(tmp_path)])
    assert missing.exit_code != 0
    (tmp_path / "secret").write_text("s" * 64)
    # A worker token names the fingerprint keys it builds; without one, the CLI says so.
    refused = runner.invoke(app, ["token", "--home", str(tmp_path), "--role", "worker"])
    assert refused.exit_code != 0 and "fingerprint keys" in refused.output
    result = runner.invoke(app, ["token", "--home", str(tmp_path), "--role", "worker",
                                 "--key", "ort-cpu-x86-64-v3-ort1.20", "--key", "trt-sm89"])
    assert result.exit_code == 0, result.output
    claims = jwt.decode(result.output.strip(), "s" * 64, algorithms=["HS256"])
    assert claims["role"] == "worker" and claims["exp"] - claims["iat"] == 30 * 24 * 3600
    assert claims["keys"] == ["ort-cpu-x86-64-v3-ort1.20", "trt-sm89"]
    # An agent token names its agent; without one, the CLI says so.
    refused = runner.invoke(app, ["token", "create", "--home", str(tmp_path), "--role", "agent"])
    assert refused.exit_code != 0 and "names its agent" in refused.output
    agent = runner.invoke(app, ["token", "create", "--home", str(tmp_path), "--role", "agent",
                                "--agent", "node-1", "--ttl", "60"])
    assert agent.exit_code == 0, agent.output
    claims = jwt.decode(agent.stdout.strip().splitlines()[0], "s" * 64, algorithms=["HS256"])
    assert claims["agent"] == "node-1" and claims["exp"] - claims["iat"] == 60
    assert f"kiln token revoke {claims['jti']}" in agent.stderr


def test_compile_with_a_plugin_bundle_and_run(tmp_path: Path):
    import importlib.util
    import sys

    examples = Path(__file__).resolve().parents[2] / "examples" / "plugins"
    spec = importlib.util.spec_from_file_location("kiln_example_models", examples / "models.py")
    models = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = models
    spec.loader.exec_module(models)

    bundle = tmp_path / "swish.tar"
    built = runner.invoke(app, ["plugin", "build", str(examples / "swish"), "--out", str(bundle)])
    assert built.exit_code == 0, built.output
    model = tmp_path / "cnn.onnx"
    model.write_bytes(models.swish_cnn().SerializeToString())
    without = runner.invoke(app, ["compile", str(model), "--out", str(tmp_path / "no")])
    assert without.exit_code != 0  # kiln.examples::Swish is unknown without its plugin
    out = tmp_path / "artifact"
    result = runner.invoke(app, ["compile", str(model), "--out", str(out),
                                 "--plugin", str(bundle), "--tune", "off"])
    assert result.exit_code == 0, result.output
    manifest = ArtifactManifest.model_validate_json((out / "manifest.json").read_text())
    assert [p.name for p in manifest.plugins] == ["swish"]
    assert list((out / "plugins").glob("*.tar"))


def test_compile_tunes_on_samples_and_prints_the_candidates(tmp_path: Path):
    model = tmp_path / "mlp.onnx"
    model.write_bytes(mlp().SerializeToString())
    samples = tmp_path / "samples.npz"
    np.savez(samples, x=np.random.default_rng(0).standard_normal((6, 2, 64)).astype(np.float32))
    out = tmp_path / "artifact"
    wide = CliRunner(env={"COLUMNS": "400"})
    result = wide.invoke(app, ["compile", str(model), "--out", str(out), "--precision",
                               "auto", "--samples", str(samples)])
    assert result.exit_code == 0, result.output
    manifest = ArtifactManifest.model_validate_json((out / "manifest.json").read_text())
    assert manifest.options.samples == manifest.inputs_source.removeprefix("dataset:")
    names = [c.name for c in manifest.tuning.candidates]
    assert "onnxruntime/int8-static-qdq-l3" in names
    assert manifest.tuning.winner in result.stderr and "int8-dynamic" in result.stderr
    bad = tmp_path / "bad.npz"
    np.savez(bad, x=np.zeros((2, 2, 63), np.float32))
    refused = runner.invoke(app, ["compile", str(model), "--out", str(tmp_path / "b"),
                                  "--samples", str(bad)])
    assert refused.exit_code != 0 and "[2, 63]" in str(refused.exception)
    assert not (tmp_path / "b").exists()

"""A confined agent has a home folder of its own beneath its cache, holding the opt-outs of
the runtimes that read the home folder (``HOME_FILES``), while the real home stays refused.

``import openvino`` initialises OpenVINO's telemetry, which, finding no consent file, took
consent as given and read and wrote a client id and usage counts in the home folder: in a
confined process that was a PermissionError, so no OpenVINO engine loaded in an agent.
``tests/integration/test_openvino_agent.py`` serves an engine from a real agent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime_agent.confine import HOME_DIRNAME, HOME_FILES, prepare_home

#: Run in a child: confine the process as the agent does, then import OpenVINO, compile a
#: small model and run it, and try the real home. Prints what happened as JSON.
CHILD = r'''
import json, os, sys
from pathlib import Path

from runtime_agent.confine import confine_agent

real_home = os.environ["HOME"]
report = confine_agent(Path(sys.argv[1]))
out = {"abi": report.abi, "home": os.environ["HOME"]}
try:
    import numpy as np
    import openvino as ov
    from openvino import opset13 as ops

    x = ops.parameter([2, 3], np.float32, name="x")
    model = ov.Model([ops.relu(x)], [x])
    compiled = ov.Core().compile_model(model, "CPU")
    y = compiled({"x": np.array([[-1, 2, -3], [4, -5, 6]], np.float32)})[0]
    out["openvino"] = y.tolist()
except Exception as exc:
    out["openvino"] = f"{type(exc).__name__}: {exc}"
try:
    os.listdir(real_home)
    out["real_home"] = "listed"
except OSError as exc:
    out["real_home"] = type(exc).__name__
print(json.dumps(out))
'''


def test_prepare_home_writes_the_opt_outs_beneath_the_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "real-home"))
    cache = tmp_path / "cache"
    (cache / HOME_DIRNAME / "intel").mkdir(parents=True)
    consent = cache / HOME_DIRNAME / "intel" / "openvino_telemetry"
    consent.write_text("1")  # anything in the agent may write beneath the cache

    home = prepare_home(cache)

    assert home == cache.resolve() / HOME_DIRNAME
    assert os.environ["HOME"] == str(home) and Path.home() == home
    for relative, content in HOME_FILES.items():
        assert (home / relative).read_text() == content
    assert consent.read_text() == "0"


def test_openvino_telemetry_reads_the_opt_out(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The opt-out is the one OpenVINO's telemetry honours (not a CI variable)."""
    checker = pytest.importorskip("openvino_telemetry.utils.opt_in_checker")
    for variable in ("CI", "TF_BUILD", "JENKINS_URL"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert checker.OptInChecker().check(False, True) is checker.ConsentCheckResult.NO_FILE
    home = prepare_home(tmp_path / "cache")
    consent = Path(checker.OptInChecker().consent_file())
    assert consent.is_relative_to(home) and consent.is_file()  # declined by reading it
    assert checker.OptInChecker().check(False, True) is checker.ConsentCheckResult.DECLINED


@pytest.mark.skipif(sys.platform != "linux", reason="Landlock is Linux's")
def test_a_confined_process_runs_openvino_and_still_cannot_read_the_real_home(
        tmp_path: Path) -> None:
    pytest.importorskip("openvino")
    real_home = tmp_path / "real-home"
    (real_home / "intel").mkdir(parents=True)  # a client id from an earlier, unconfined run
    (real_home / "intel" / "openvino_ga_cid").write_text("0123")
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "TF_BUILD", "JENKINS_URL")}
    env["HOME"] = str(real_home)
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "cache")], env=env,
                          capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if not out["abi"]:
        pytest.skip(f"Landlock is unavailable here: {done.stderr[-500:]}")
    assert out["openvino"] == [[0, 2, 0], [4, 0, 6]], out
    assert out["real_home"] == "PermissionError", out
    assert Path(out["home"]).is_relative_to((tmp_path / "cache").resolve())
    assert not (real_home / "intel" / "stats").exists()

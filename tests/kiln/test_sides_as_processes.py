"""``kiln`` runs the control plane's and the worker's commands as their own processes
(``python -m services``, ``python -m compiler_worker``): a ``kiln`` process that shows the
settings, mints a token, keeps the keys or sets up the embedded stack loads no module of
either side, and the sides' entry points answer for themselves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SECRET = "s3cret-0123456789abcdef-0123456789abcdef"
#: Run in a fresh interpreter: what it prints is every module of either side it loaded.
PROBE = """
import sys
from typer.testing import CliRunner
from kiln.cli import app
from kiln.stack import EmbeddedStack
runner = CliRunner()
for args in (["config", "--json"], ["token", "create", "--role", "reader"], ["keys", "init"]):
    result = runner.invoke(app, args)
    assert result.exit_code == 0, (args, result.output)
stack = EmbeddedStack(home=__import__("pathlib").Path(sys.argv[1]) / "stack")
stack.prepare()
assert stack.token and stack.worker_token and stack.agent_token
print(sorted(m for m in sys.modules if m.split(".")[0] in ("services", "compiler_worker")))
"""


def _env(tmp_path: Path) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    return {**base, "KILN_ENV": "dev", "KILN_HOME": str(tmp_path), "KILN_SECRET_KEY": SECRET}


def test_kiln_loads_no_module_of_the_control_plane_or_the_worker(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path)], env=_env(tmp_path),
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"
    assert (tmp_path / "trust").is_dir() and (tmp_path / "stack" / "kiln.db").is_file()


def test_each_side_prints_its_own_settings(tmp_path: Path) -> None:
    for module, component in (("services", "api"), ("compiler_worker", "worker")):
        proc = subprocess.run([sys.executable, "-m", module, "settings"], env=_env(tmp_path),
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        rows = json.loads(proc.stdout)
        assert {r["component"] for r in rows} == {component}
        assert "KILN_BROKER_URL" in {r["name"] for r in rows}
        proc = subprocess.run([sys.executable, "-m", module, "settings", "--effective"],
                              env=_env(tmp_path), capture_output=True, text=True, timeout=120)
        values = {r["name"]: r for r in json.loads(proc.stdout)}
        assert values["KILN_ENV"]["value"] == "dev" and values["KILN_ENV"]["source"] == "env"
    secret = {r["name"]: r for r in json.loads(subprocess.run(
        [sys.executable, "-m", "services", "settings", "--effective"], env=_env(tmp_path),
        capture_output=True, text=True, timeout=120).stdout)}["KILN_SECRET_KEY"]
    assert secret["value"] == "***"  # redacted on its side, before it is printed

"""A custom-op plugin inside a real agent process (``kiln agent``, started the way ``kiln up``
starts its agent) reaches for what it should not: the control plane's signing key and JWT
secret, a file outside its folder, ``/etc/shadow``, a write outside its folder, a local port.
Each attempt fails; the plugin still runs and serves (it records what it could do in its own
folder, the one place it may write)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from kiln.stack import agent_environment
from tests.plugins.helpers import compile_signed, pack, scale_model, scale_plugin, unique_domain
from tests.runtime_agent.helpers import (
    TOKEN,
    ControlPlaneStub,
    Fixtures,
    desired_model,
    free_port,
    wait_for,
)

#: The plugin's kernel: y = factor * x, and, once, every probe's outcome written beside it.
PROBE_MODULE = '''
import json, os, socket
from pathlib import Path

import numpy as np
from kiln.ops import TensorType

PROBES = {probes!r}
_done = []


def _try(fn):
    try:
        fn()
        return True
    except Exception as exc:
        return type(exc).__name__


def _write_outside():
    Path(PROBES["write_outside"]).write_text("written by a plugin")
    Path(PROBES["write_outside"]).unlink()


def _connect():
    with socket.create_connection(("127.0.0.1", PROBES["port"]), timeout=3):
        pass


def _probe():
    environ = Path("/proc/self/environ").read_bytes()
    return {{
        "own_module": _try(lambda: Path(__file__).read_bytes()),
        "signing_key": _try(lambda: Path(PROBES["signing_key"]).read_bytes()),
        "secret_file": _try(lambda: Path(PROBES["secret_file"]).read_bytes()),
        "outside_file": _try(lambda: Path(PROBES["outside_file"]).read_bytes()),
        "shadow": _try(lambda: Path("/etc/shadow").read_bytes()),
        "parent_environ": _try(lambda: Path(f"/proc/{{os.getppid()}}/environ").read_bytes()),
        "write_outside": _try(_write_outside),
        "connect_local_port": _try(_connect),
        "jwt_secret_env": "KILN_SECRET_KEY" in os.environ or b"KILN_SECRET_KEY" in environ,
        "signing_key_env": ("KILN_SIGNING_KEY_PATH" in os.environ
                            or b"KILN_SIGNING_KEY_PATH" in environ),
    }}


def shape(inputs, attributes):
    return [TensorType(inputs[0].dtype, inputs[0].shape)]


def kernel(ctx, inputs, outputs, attributes):
    if not _done:
        _done.append(True)
        Path(__file__).with_name("probes.json").write_text(json.dumps(_probe()))
    np.multiply(inputs[0].numpy(), attributes["factor"], out=outputs[0].numpy())
'''


@pytest.fixture
def listener():
    """A local TCP port that accepts (what the database or the broker would be)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        yield server.getsockname()[1]


def test_a_plugin_in_the_agent_reaches_no_secret_and_nothing_outside_its_folder(
        control_plane: ControlPlaneStub, built: Fixtures, tmp_path: Path, listener: int,
        ) -> None:
    home = tmp_path / "home"  # the control plane's state, as kiln up keeps it
    home.mkdir()
    (home / "signing.key").write_text("-----BEGIN PRIVATE KEY----- not for plugins")
    (home / "secret").write_text("jwt-secret-not-for-plugins")
    (tmp_path / "outside.txt").write_text("not the plugin's")
    probes = {"signing_key": str(home / "signing.key"), "secret_file": str(home / "secret"),
              "outside_file": str(tmp_path / "outside.txt"),
              "write_outside": str(home / "written-by-plugin"), "port": listener}
    domain = unique_domain()
    bundle = pack(scale_plugin(tmp_path / "probe-plugin", domain=domain, name="probe",
                               module=PROBE_MODULE.format(probes=probes)),
                  tmp_path / "probe.tar")
    artifact = control_plane.add(compile_signed(scale_model(domain), [bundle.plugin],
                                                tmp_path / "artifact", built.keys.signer))
    control_plane.desired = [desired_model("probe", artifact)]

    port, cache = free_port(), tmp_path / "cache"
    # The environment kiln up's API has, filtered as kiln up filters it for its agent.
    env = agent_environment({**os.environ, "KILN_HOME": str(home),
                             "KILN_SECRET_KEY": "jwt-secret-not-for-plugins",
                             "KILN_SIGNING_KEY_PATH": str(home / "signing.key")})
    env["KILN_AGENT_TOKEN"] = TOKEN
    log = tmp_path / "agent.log"
    with log.open("wb") as out:
        agent = subprocess.Popen(
            [sys.executable, "-m", "kiln.cli", "agent", "--api", control_plane.url,
             "--name", "node-1", "--port", str(port), "--cache-dir", str(cache),
             "--trusted-key", str(built.keys.public)],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        def served() -> bool:
            assert agent.poll() is None, log.read_text()
            try:
                answer = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            except httpx.TransportError:
                return False
            return answer.status_code == 200 and any(m["name"] == "probe"
                                                     for m in answer.json())

        wait_for(served, timeout_s=90, what=f"the probe model served\n{log.read_text()}")
        x = np.ones((1, 8), np.float32)
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/models/probe/infer",
                            json={"inputs": {"x": x.tolist()}}, timeout=10)
        assert answer.status_code == 200, answer.text
        np.testing.assert_allclose(answer.json()["outputs"]["y"], 2 * x)

        (found,) = [p for p in cache.rglob("probes.json")]
        outcome = json.loads(found.read_text())
        assert outcome["own_module"] is True, outcome  # the probes did run, in the agent
        for probe in ("signing_key", "secret_file", "outside_file", "shadow",
                      "parent_environ", "write_outside", "connect_local_port",
                      "jwt_secret_env", "signing_key_env"):
            assert outcome[probe] is not True, (probe, outcome)
        assert not (home / "written-by-plugin").exists()
        assert "agent confined (Landlock" in log.read_text()
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGTERM)
            agent.wait(30)


def test_what_the_agent_may_read_leaves_out_state_beside_the_code() -> None:
    """The readable paths hold the code, never a state folder beside it."""
    from runtime_agent.confine import readable_paths

    roots, _ = readable_paths()
    repo = Path(__file__).resolve().parents[2]
    assert str(repo / "runtime_agent") in roots
    assert str(repo) not in roots and str(repo / ".kiln") not in roots
    assert not any(Path(r) in (Path("/etc"), Path("/tmp"), Path("/proc")) for r in roots)

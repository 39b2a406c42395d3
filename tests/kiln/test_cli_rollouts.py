"""``kiln deploy --stages``, ``kiln rollouts`` and ``kiln rollout pause|resume|abort`` against a
real API server on loopback (uvicorn, SQLite). The agents are registered over HTTP; the failing
gate report stands for what an agent measures on a bad engine."""

from __future__ import annotations

from pathlib import Path

import httpx
from typer.testing import CliRunner

from kiln.cli import app
from kiln.examples import mlp, small_cnn
from schemas.errors import ErrorCode, KilnError
from tests.kiln.test_cli_datasets import LiveApi, live_api
from tests.services.api.conftest import make_settings, registration
from tests.services.api.test_fleet import KEY, record

__all__ = ["live_api"]
runner = CliRunner(env={"COLUMNS": "250"})


def test_rollout_commands(live_api: LiveApi, tmp_path: Path, monkeypatch) -> None:
    from kiln.cli.common import console

    # The console is made at import, when COLUMNS may be unset (CI has no terminal: 80).
    monkeypatch.setattr(console, "width", 250)
    settings = make_settings(tmp_path / "api")
    headers = {"Authorization": f"Bearer {live_api.token}"}
    with live_api.client() as client:
        old = client.upload_model(mlp().SerializeToString(), name="old").id
        new = client.upload_model(small_cnn().SerializeToString(), name="new").id
    for model_id in (old, new):
        record(settings, model_id, KEY)
    for name in ("n-1", "n-2"):
        answer = httpx.post(f"{live_api.url}/v1/agents", timeout=60, headers=headers,
                            json=registration(name, KEY, {"app": "svc"}))
        assert answer.status_code == 200, answer.text

    first = runner.invoke(app, ["deploy", old, "--name", "svc", "-l", "app=svc"])
    assert first.exit_code == 0, first.output
    bad = runner.invoke(app, ["deploy", new, "--name", "svc", "-l", "app=svc",
                              "--stages", "10%,5%,100%"])
    # The API refuses the policy (422); the CLI's entry point prints the KilnError it raises.
    assert isinstance(bad.exception, KilnError)
    assert "overlaps the stage before (10%)" in bad.exception.message
    started = runner.invoke(app, ["deploy", new, "--name", "svc", "-l", "app=svc",
                                  "--stages", "1,100%", "--soak-s", "0"])
    assert started.exit_code == 0, started.output
    assert "rollout" in started.output and "started" in started.output

    listed = runner.invoke(app, ["rollouts"])
    assert listed.exit_code == 0, listed.output
    assert KEY in listed.output and "1 → 100%" in listed.output
    assert "1/2 (1) running" in listed.output and "1/2" in listed.output

    report = httpx.post(f"{live_api.url}/v1/rollouts/svc/reports", headers=headers, timeout=60,
                        json={"agent": "n-1", "gates": [{
                            "name": "golden", "passed": False, "worst_index": 3,
                            "max_abs_error": 0.75}]})
    assert report.status_code == 200, report.text
    halted = runner.invoke(app, ["rollouts", "--active"])
    assert "halted" in halted.output and "worst element 3" in halted.output
    assert "0/2" in halted.output

    paused = runner.invoke(app, ["rollout", "pause", "svc"])
    assert isinstance(paused.exception, KilnError)
    assert paused.exception.code is ErrorCode.CONFLICT
    assert "it is halted" in paused.exception.message
    aborted = runner.invoke(app, ["rollout", "abort", "svc"])
    assert aborted.exit_code == 0 and "aborted" in aborted.output, aborted.output
    assert runner.invoke(app, ["rollouts", "--active"]).output.count(KEY) == 0
    assert runner.invoke(app, ["rollout", "explode", "svc"]).exit_code == 2

"""Help texts say what a command really needs."""

from __future__ import annotations

from typer.testing import CliRunner

from kiln.cli import app


def test_agent_build_help_names_no_control_plane_secret() -> None:
    # A node that builds for itself publishes through the API with a worker token; it never
    # holds the control plane's database URL or store (the worker refuses to start with them).
    result = CliRunner().invoke(app, ["agent", "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    assert "KILN_WORKER_TOKEN" in result.output and "KILN_BROKER_URL" in result.output
    for secret in ("KILN_DATABASE_URL", "KILN_STORE_URI"):
        assert secret not in result.output

"""The ``kiln`` command line.

User commands talk to the API through the SDK. ``api``, ``worker`` and ``up`` start the
services; ``compile`` runs the compile pipeline in this process with no services at all.
"""

# The docstring above is ``kiln --help``'s text. The commands live in one module per role
# (serve, admin, remote, fleet, local); they are registered here, in the order ``kiln --help``
# lists them, so the listing stays one table of contents whatever module a command is in.

from __future__ import annotations

import typer

from kiln.cli import admin, fleet, local, remote, serve
from kiln.cli.common import err
from schemas.blas import one_blas_thread
from schemas.exit_codes import run_reporting_errors

app = typer.Typer(no_args_is_help=True, add_completion=True, help=__doc__)

app.command()(serve.api)
app.command()(serve.worker)
app.command()(serve.agent)
app.command()(serve.up)
app.command()(admin.keygen)
app.command("config")(admin.config_)
app.command()(remote.submit)
app.command()(remote.rebuild)
app.command()(admin.gc)
app.command()(fleet.deploy)
app.command()(fleet.rollouts)
app.command()(fleet.rollout)
app.command()(fleet.deployments)
app.command()(fleet.agents)
app.command()(fleet.workers)
app.command()(fleet.fleet)
app.command()(remote.plugins)
app.command()(remote.datasets)
app.command()(remote.tuning)
app.command()(local.fingerprint)
app.command()(local.compile)
app.command()(local.run)
app.command("exit-codes")(local.exit_codes_)
app.command()(serve.demo)

app.add_typer(admin.token_app, name="token")
app.add_typer(admin.store_app, name="store")
app.add_typer(remote.jobs_app, name="jobs")
app.add_typer(remote.artifacts_app, name="artifacts")
app.add_typer(admin.keys_app, name="keys")
app.add_typer(remote.plugin_app, name="plugin")
app.add_typer(remote.dataset_app, name="dataset")


def main() -> None:
    # Before any command loads numpy: ``kiln agent`` serves engines and ``kiln compile``
    # times them, each with its own thread pools (schemas.blas says why).
    one_blas_thread()
    run_reporting_errors(app, err)

"""``python -m compiler_worker``: a compiler worker's own command line. ``kiln worker`` (and
an agent's ``--build``) becomes this process: ``kiln`` imports nothing of the worker but for
``kiln compile`` and ``kiln run``. ``settings`` prints this side's settings table for
``kiln config``."""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Annotated
from urllib.parse import urlsplit, urlunsplit

import typer

from schemas.blas import one_blas_thread
from schemas.console import consoles
from schemas.errors import ConfigError, KilnError
from schemas.exit_codes import exit_code
from schemas.settings_table import effective, log_effective, variables_of

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
_, err = consoles()

#: Seconds the broker has to answer at start-up.
BROKER_TIMEOUT_S = 5.0


def _redact_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.replace(f":{parts.password}@",
                                                                 ":***@")))


def _check_broker(settings) -> None:
    """``ConfigError`` naming the fix unless the broker answers (the server-less filesystem
    broker is a local folder, made when the queue is configured: nothing to reach)."""
    from compiler_worker.queue import broker_probe

    url = settings.broker_url or ""
    if url.startswith("filesystem"):
        return
    try:
        broker_probe(settings, timeout_s=BROKER_TIMEOUT_S)()
    except Exception as exc:  # any transport failure: the worker cannot consume
        raise ConfigError(
            f"the broker at {_redact_url(url)} does not answer ({type(exc).__name__}: {exc}); "
            f"start it (e.g. `docker compose up -d redis`), or fix KILN_BROKER_URL",
            broker=_redact_url(url)) from exc


@app.command()
def worker(
    concurrency: Annotated[int | None, typer.Option(min=1)] = None,
    pool: Annotated[str, typer.Option(help="celery pool: prefork or solo")] = "prefork",
    name: Annotated[str | None, typer.Option(
        help="worker name shown on jobs (default: KILN_WORKER_NAME)")] = None,
) -> None:
    """Run a compiler worker consuming the queues of this machine's fingerprint keys, with
    the settings of its environment (KILN_WORKER_*, KILN_BROKER_URL, ...). The unknown-variable
    check is its launcher's (``kiln worker``), which knows every side's variables."""
    one_blas_thread()  # before the backends load numpy (schemas.blas says why)
    if name:
        os.environ["KILN_WORKER_NAME"] = name
    from compiler_worker.config import get_worker_settings

    settings = get_worker_settings()
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings.check_explicit()
    log_effective(settings, "worker", os.environ, logging.getLogger("kiln.worker"))
    settings.check_no_secrets(os.environ)
    _check_broker(settings)  # the broker answers; the worker reaches the rest through the API
    from compiler_worker.worker import run_worker

    run_worker(concurrency=concurrency, pool=pool, settings=settings)


@app.command()
def settings(
    values: Annotated[bool, typer.Option(
        "--effective", help="the effective values and their sources, not the variables")
    ] = False,
) -> None:
    """This side's settings table as JSON: every variable it reads, or with --effective each
    value, redacted, and its source; settings that do not validate give {"invalid": ...}."""
    from pydantic import ValidationError

    from compiler_worker.config import WorkerSettings

    if not values:
        rows: object = [vars(v) for v in variables_of("worker", WorkerSettings)]
    else:
        try:
            rows = [vars(r) for r in effective(WorkerSettings(), os.environ)]
        except ValidationError as exc:
            rows = {"invalid": str(exc)}
    sys.stdout.write(json.dumps(rows, indent=2, default=str) + "\n")


def main() -> None:
    try:
        app()
    except KilnError as exc:
        err.print(f"[red]error[/] ({exc.code}): {exc.message}")
        sys.exit(exit_code(exc.code))


if __name__ == "__main__":
    main()

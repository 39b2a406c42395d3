"""``kiln`` commands that run Kiln: the control-plane API, a compiler worker, a runtime
agent, the embedded stack and the demo on it."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from kiln.cli.common import (
    console,
    err,
)


def _setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def api(
    host: Annotated[str | None, typer.Option()] = None,
    port: Annotated[int | None, typer.Option()] = None,
    processes: Annotated[int | None, typer.Option(
        min=1, max=64, help="processes serving the port (default: KILN_API_PROCESSES)")] = None,
    agent_port: Annotated[int | None, typer.Option(
        min=1, max=65535, help="a second port, served by processes of its own, for the "
        "agents (default: KILN_API_AGENT_PORT)")] = None,
    agent_processes: Annotated[int | None, typer.Option(
        min=1, max=64, help="processes serving --agent-port (default: "
        "KILN_API_AGENT_PROCESSES)")] = None,
) -> None:
    """Run the control-plane API."""
    from kiln.settings import launch_check

    launch_check("api", os.environ)  # every side's variables are known here, not there
    given = {"--host": host, "--port": port, "--processes": processes,
             "--agent-port": agent_port, "--agent-processes": agent_processes}
    _become("services", "api", *(part for flag, value in given.items() if value is not None
                                 for part in (flag, str(value))))


def _become(module: str, *args: str) -> None:
    """Replace this process by ``python -m MODULE ARGS``: the side's own entry point, so that
    ``kiln`` imports nothing of it, and its signals, exit status and output are the
    command's."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", module, *args])


def worker(
    name: Annotated[str | None, typer.Option(help="worker name shown on jobs")] = None,
    concurrency: Annotated[int | None, typer.Option(min=1)] = None,
    pool: Annotated[str, typer.Option(help="celery pool: prefork or solo")] = "prefork",
    fingerprint_file: Annotated[Path | None, typer.Option(exists=True)] = None,
    api_url: Annotated[str | None, typer.Option(
        "--api", help="control-plane URL the worker claims jobs, fetches inputs and "
        "publishes through (default: KILN_WORKER_API_URL)")] = None,
    token_: Annotated[str | None, typer.Option(
        "--token", help="worker token scoped to this machine's fingerprint keys (default: "
        "KILN_WORKER_TOKEN; mint one with `kiln token create --role worker --key KEY`)")
    ] = None,
) -> None:
    """Run a compiler worker consuming the queues of this machine's fingerprint keys. It
    holds no database URL, store credential or secret: it speaks to the control plane over
    HTTP with a worker token, and the control plane signs what it builds."""
    if api_url:
        os.environ["KILN_WORKER_API_URL"] = api_url
    if token_:
        os.environ["KILN_WORKER_TOKEN"] = token_
    if name:
        os.environ["KILN_WORKER_NAME"] = name
    if fingerprint_file:
        os.environ["KILN_FINGERPRINT_FILE"] = str(fingerprint_file)
    from kiln.settings import launch_check

    launch_check("worker", os.environ)
    _become("compiler_worker", "worker", "--pool", pool,
            *(["--concurrency", str(concurrency)] if concurrency is not None else []))


def _start_up(settings, component: str, *, production: bool) -> None:
    """Refuse unknown ``KILN_*`` variables (production) and the embedded defaults
    (production, control plane), then log the effective configuration, secrets redacted."""
    from kiln.settings import start_up

    if hasattr(settings, "check_explicit"):  # the api's and the worker's settings
        settings.check_explicit()
    start_up(settings, component, os.environ, logging.getLogger(f"kiln.{component}"),
             production=production)


def agent(
    api_url: Annotated[str | None, typer.Option(
        "--api", help="control-plane URL (default: KILN_AGENT_API_URL, else like the other "
        "commands: KILN_API_URL, then $KILN_HOME/client.json)")] = None,
    token_: Annotated[str | None, typer.Option(
        "--token", help="bearer token with the agent role (default: KILN_AGENT_TOKEN, "
        "KILN_TOKEN, $KILN_HOME/client.json)")] = None,
    labels: Annotated[str | None, typer.Option(help="k=v,k2=v2 (matched by deployment "
                                                    "selectors)")] = None,
    name: Annotated[str | None, typer.Option(help="agent name (default: the host name)")] = None,
    host: Annotated[str | None, typer.Option(help="inference server host")] = None,
    port: Annotated[int | None, typer.Option(help="inference server port; 0: none")] = None,
    cache_dir: Annotated[Path | None, typer.Option(help="artifact cache folder")] = None,
    root_key: Annotated[list[Path] | None, typer.Option(
        "--root-key", exists=True, dir_okay=False,
        help="root public key (Ed25519, PEM): the agent follows the control plane's root "
        "metadata from it to the current signing key, so key rotation needs no change here; "
        "repeatable (default: $KILN_HOME/root.key.pub when it exists)")] = None,
    trusted_key: Annotated[list[Path] | None, typer.Option(
        "--trusted-key", exists=True, dir_okay=False,
        help="online public key (Ed25519, PEM) trusted directly instead of a root key; "
        "repeatable")] = None,
    fingerprint_file: Annotated[Path | None, typer.Option(exists=True)] = None,
    build: Annotated[bool, typer.Option(
        "--build", help="also run a compiler worker for this node's own hardware (build on "
        "device: its fingerprint keys and its own tuning-context keys, KEY-t-...; needs "
        "KILN_WORKER_TOKEN, a worker token for this node's keys, and "
        "KILN_BROKER_URL, the queue it consumes; it reaches the control plane over HTTP "
        "only, at --api unless KILN_WORKER_API_URL says otherwise, and holds no database "
        "URL, store credential or signing key)")] = False,
) -> None:
    """Run a runtime agent: register, pull the engines deployed to this node, serve them."""
    from pydantic import ValidationError

    from kiln.config import ClientSettings
    from runtime_agent.agent import run_agent
    from runtime_agent.config import AgentSettings
    from schemas.errors import ConfigError

    given = {"api_url": api_url, "token": token_, "labels": labels, "name": name,
             "serve_host": host, "serve_port": port, "cache_dir": cache_dir,
             "trusted_keys": trusted_key or None, "root_keys": root_key or None,
             "fingerprint_file": fingerprint_file}
    try:
        settings = AgentSettings(**{k: v for k, v in given.items() if v is not None})
    except ValidationError as exc:
        raise ConfigError(f"invalid agent settings: {exc}") from exc
    client = ClientSettings()
    default_url, default_token = client.resolved()
    updates: dict[str, object] = {}
    if "api_url" not in settings.model_fields_set:
        updates["api_url"] = default_url
    if "token" not in settings.model_fields_set and default_token:
        updates["token"] = default_token
    default_root = client.home / "root.key.pub"
    if not settings.trusted_keys and not settings.root_keys and default_root.is_file():
        updates["root_keys"] = [default_root]
    settings = settings.model_copy(update=updates)
    _setup_logging(settings.log_level)
    from kiln.settings import is_production

    _start_up(settings, "agent", production=is_production())
    builder = (_start_builder(settings.name, fingerprint_file, settings.api_url) if build
               else None)
    try:
        run_agent(settings)
    finally:
        if builder is not None:
            builder.terminate()
            builder.wait(30)


def _start_builder(agent_name: str, fingerprint_file: Path | None, api_url: str):
    """A ``kiln worker`` child process building for this node's own fingerprint keys and, beside
    each, its own tuning context's (``compiler_worker.worker.fingerprint_keys``: the node
    builds the tuning the control plane queues for it). It publishes through the agent's
    control plane unless KILN_WORKER_API_URL says otherwise, with its own worker token
    (KILN_WORKER_TOKEN) and none of the agent's secrets."""
    import subprocess

    from kiln.stack import worker_environment

    argv = [sys.executable, "-m", "kiln.cli", "worker", "--name", f"{agent_name}-build"]
    if fingerprint_file:
        argv += ["--fingerprint-file", str(fingerprint_file)]
    env = worker_environment(os.environ)  # not the agent's token, nor any store credential
    env.setdefault("KILN_WORKER_API_URL", api_url)
    return subprocess.Popen(argv, env=env)


def up(
    port: Annotated[int, typer.Option()] = 8000,
    home: Annotated[Path, typer.Option(envvar="KILN_HOME")] = Path(".kiln"),
    workers: Annotated[int, typer.Option(min=0)] = 1,
    agent_labels: Annotated[str | None, typer.Option(
        "--agent", help="also run a local runtime agent with these labels (k=v,...)")] = None,
    agent_port: Annotated[int, typer.Option(help="the local agent's inference port")] = 8100,
) -> None:
    """Start the embedded stack (API + worker, SQLite, local store, no broker server)."""
    from kiln.stack import EmbeddedStack

    stack = EmbeddedStack(home=home, port=port, workers=workers, agent_labels=agent_labels,
                          agent_port=agent_port)
    with console.status("starting the embedded stack"):
        try:
            stack.start()
        except Exception:
            stack.stop()
            raise
    console.print(f"[green]Kiln is up[/] at {stack.api_url}  (state in {stack.home})")
    console.print(f"  logs: {stack.home / 'logs'};  `kiln submit MODEL.onnx --wait` from "
                  f"another shell (KILN_HOME={stack.home})")
    from kiln.config import CLIENT_FILE

    console.print(f"  dashboard: {stack.api_url}/ui  (sign in with a token from "
                  f"`kiln token create --role reader`, or with the admin token in "
                  f"{stack.home / CLIENT_FILE})")
    if agent_labels is not None:
        console.print(f"  agent: {stack.agent_url}  (labels {agent_labels}; Open Inference "
                      f"Protocol at {stack.agent_url}/v2, metrics at {stack.agent_url}/metrics)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while all(p.poll() is None for p in stack.processes):
            time.sleep(0.5)
        for proc in stack.processes:
            if proc.returncode is not None:
                err.print(f"[red]{stack.describe(proc)} exited with {proc.returncode}; "
                          f"stopping the stack (logs: {stack.home / 'logs'})[/]")
    except KeyboardInterrupt:
        pass
    finally:
        stack.stop()



def demo(
    port: Annotated[int, typer.Option()] = 8000,
    agent_port: Annotated[int, typer.Option()] = 8100,
    home: Annotated[Path, typer.Option(envvar="KILN_HOME")] = Path(".kiln"),
) -> None:
    """The main job on the embedded stack: build a model in code, compile it for this machine,
    deploy it to a local agent, serve an inference and compare it with a reference."""
    from kiln.demo import run_demo

    raise typer.Exit(run_demo(home=home, port=port, agent_port=agent_port, console=console))

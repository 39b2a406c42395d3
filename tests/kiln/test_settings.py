"""Every ``KILN_*`` variable: production refuses what it would otherwise default or drop,
start-up logs are redacted, ``kiln config`` says where values came from, and the README's
table is the generated one."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.exit_codes import EXIT_CODES
from kiln.settings import (
    SIDES_FILE,
    asked_sides,
    check_environment,
    effective,
    log_effective,
    markdown_table,
    readme_table,
    redact,
    unknown_variables,
    variables,
)
from schemas.errors import ConfigError, ErrorCode
from services.config import KilnSettings

ROOT = Path(__file__).resolve().parents[2]
SECRET = "s3cret-0123456789abcdef-0123456789abcdef"
logger = logging.getLogger("test.settings")


def test_readme_table_is_the_generated_one() -> None:
    assert readme_table((ROOT / "README.md").read_text()) == markdown_table(), (
        "README.md's settings table is stale: paste `kiln config --markdown` between its markers"
    )


def test_the_recorded_side_settings_are_what_the_sides_print() -> None:
    """Launchers read the api's and the worker's variables from ``SIDES_FILE`` instead of
    asking each side on every start: a setting added to a side and not recorded would be
    refused as unknown by the launcher that starts that very side."""
    assert json.loads(SIDES_FILE.read_text()) == asked_sides(), (
        f"{SIDES_FILE.name} is stale: run `python -m kiln.settings`")


def test_every_variable_is_documented() -> None:
    names = {v.name for v in variables()}
    assert {"KILN_S3_REGION", "KILN_PRESIGN_TTL_S",
            "KILN_AGENT_TRUSTED_KEYS", "KILN_AGENT_SERVE_TOKEN", "KILN_WORKER_NAME",
            "KILN_API_URL"} <= names
    assert "KILN_TRUSTED_KEYS" not in names  # read by nothing: not a setting any more
    assert [v.name for v in variables() if not v.doc] == []


def test_production_refuses_the_embedded_defaults(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        KilnSettings(home=tmp_path, secret_key=SECRET).check_explicit()
    for name in ("KILN_DATABASE_URL", "KILN_BROKER_URL", "KILN_STORE_URI", "KILN_ENV=dev"):
        assert name in info.value.message
    partial = KilnSettings(home=tmp_path, secret_key=SECRET, database_url="sqlite:///x.db",
                           broker_url="redis://127.0.0.1:6379/0")
    with pytest.raises(ConfigError, match="KILN_STORE_URI") as info:
        partial.check_explicit()
    assert "KILN_DATABASE_URL" not in info.value.message
    KilnSettings(home=tmp_path, env="dev").check_explicit()  # dev may default
    KilnSettings(home=tmp_path, secret_key=SECRET, database_url="sqlite:///x.db",
                 broker_url="redis://127.0.0.1:6379/0",
                 store_uri=tmp_path.as_uri()).check_explicit()


def test_unknown_variables_are_named_with_the_likely_fix(caplog) -> None:
    environ = {"KILN_DATABSE_URL": "x", "KILN_HOME": "h", "KILN_AGENT_LABELS": "a=b",
               "KILN_TEST_REDIS_URL": "r", "KILN_TOKEN": "t", "PATH": "/bin"}
    assert unknown_variables(environ) == {"KILN_DATABSE_URL": ["KILN_DATABASE_URL"]}
    with pytest.raises(ConfigError, match=r"KILN_DATABSE_URL \(did you mean KILN_DATABASE_URL"):
        check_environment(environ, production=True, logger=logger)
    with caplog.at_level(logging.WARNING, logger="test.settings"):
        check_environment(environ, production=False, logger=logger)
    assert "KILN_DATABSE_URL" in caplog.text
    check_environment({"KILN_HOME": "h"}, production=True, logger=logger)


def test_secrets_are_redacted(caplog) -> None:
    assert redact("database_url", "postgresql+psycopg://kiln:hunter2@db:5432/kiln") == \
        "postgresql+psycopg://kiln:***@db:5432/kiln"
    assert redact("broker_url", "redis://:hunter2@redis:6379/0") == "redis://:***@redis:6379/0"
    assert redact("broker_url", "redis://redis:6379/0") == "redis://redis:6379/0"
    settings = KilnSettings(env="dev", secret_key=SECRET,
                            database_url="postgresql+psycopg://kiln:hunter2@db/kiln")
    environ = {"KILN_SECRET_KEY": SECRET, "KILN_DATABASE_URL": "x"}
    with caplog.at_level(logging.INFO, logger="test.settings"):
        log_effective(settings, "api", environ, logger)
    assert "KILN_DATABASE_URL=postgresql+psycopg://kiln:***@db/kiln [env]" in caplog.text
    assert "KILN_STORE_URI=file://" in caplog.text and "[default (KILN_HOME)]" in caplog.text
    assert SECRET not in caplog.text and "hunter2" not in caplog.text
    rows = {r.name: r for r in effective(settings, environ)}
    assert rows["KILN_SECRET_KEY"].value == "***" and rows["KILN_SECRET_KEY"].source == "env"
    assert rows["KILN_ENV"].source == "flag" and rows["KILN_S3_REGION"].source == "default"


def _kiln(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    return subprocess.run([sys.executable, "-m", "kiln.cli", *args], env={**base, **env},
                          cwd=cwd, capture_output=True, text=True, timeout=120)


def test_processes_refuse_to_start_naming_the_fix(tmp_path: Path) -> None:
    proc = _kiln("api", env={"KILN_SECRET_KEY": SECRET, "KILN_HOME": str(tmp_path)},
                 cwd=tmp_path)
    assert proc.returncode == EXIT_CODES[ErrorCode.CONFIG_ERROR], proc.stderr
    assert "KILN_BROKER_URL" in proc.stderr and "KILN_ENV=dev" in proc.stderr
    assert not (tmp_path / "kiln.db").exists()  # refused before touching anything
    named = {"KILN_SECRET_KEY": SECRET, "KILN_HOME": str(tmp_path),
             "KILN_DATABASE_URL": f"sqlite:///{tmp_path / 'k.db'}",
             "KILN_BROKER_URL": "filesystem://", "KILN_STORE_URI": tmp_path.as_uri()}
    proc = _kiln("worker", env={**named, "KILN_WORKER_CONCURENCY": "2"}, cwd=tmp_path)
    assert proc.returncode == EXIT_CODES[ErrorCode.CONFIG_ERROR], proc.stderr
    assert "did you mean KILN_WORKER_CONCURRENCY" in proc.stderr.replace("\n", " ")


def test_kiln_config_says_where_each_value_came_from(tmp_path: Path) -> None:
    (tmp_path / "client.json").write_text(json.dumps({"api_url": "http://h:1", "token": "tok"}))
    proc = _kiln("config", "--json", env={"KILN_HOME": str(tmp_path), "KILN_S3_REGION": "eu-west-3",
                                          "KILN_AGENT_LABLES": "a=b"}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    api = {r["name"]: r for r in out["components"]["api"]}
    assert api["KILN_S3_REGION"] == {"name": "KILN_S3_REGION", "value": "eu-west-3",
                                     "source": "env"}
    assert api["KILN_DATABASE_URL"]["source"] == "default (KILN_HOME)"
    cli = {r["name"]: r for r in out["components"]["cli"]}
    assert cli["KILN_API_URL"]["value"] == "http://h:1"
    assert cli["KILN_API_URL"]["source"].startswith("file ")
    assert cli["KILN_TOKEN"]["value"] == "***"
    assert out["unknown"]["KILN_AGENT_LABLES"][0] == "KILN_AGENT_LABELS"  # the closest first
    proc = _kiln("config", "--markdown", env={}, cwd=tmp_path)
    assert proc.stdout.strip() == markdown_table()


def test_a_worker_is_started_with_none_of_the_control_planes_or_an_agents_secrets() -> None:
    """What `kiln up` and `kiln agent --build` hand a compiler worker: the variables a worker
    reads, and nothing that would let a plugin running beside it sign, mint tokens, reach the
    database or the store, or speak as the agent."""
    from kiln.stack import worker_environment

    env = {"PATH": "/usr/bin", "HOME": "/home/kiln",
           "KILN_BROKER_URL": "redis://broker:6379/0", "KILN_WORKER_TOKEN": "w",
           "KILN_WORKER_API_URL": "http://api:8000", "KILN_LOG_LEVEL": "INFO",
           "KILN_SECRET_KEY": "s", "KILN_SIGNING_KEY_PATH": "/keys/signing.key",
           "KILN_DATABASE_URL": "postgresql://db/kiln", "KILN_STORE_URI": "s3://bucket/kiln",
           "KILN_S3_ENDPOINT_URL": "http://s3:9000", "KILN_AGENT_TOKEN": "a",
           "KILN_AGENT_SERVE_TOKEN": "t", "KILN_TOKEN": "admin",
           "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "v", "aws_session_token": "x"}
    kept = worker_environment(env)
    assert kept == {k: env[k] for k in ("PATH", "HOME", "KILN_BROKER_URL", "KILN_WORKER_TOKEN",
                                          "KILN_WORKER_API_URL", "KILN_LOG_LEVEL")}



def test_a_stacks_worker_is_the_sides_entry_point_with_its_pool_and_hardware(
        tmp_path: Path) -> None:
    """The stack starts a worker as ``python -m compiler_worker worker`` with its name and pool
    on the command line and its declared hardware in the environment, as ``kiln worker`` would;
    a pool the worker does not have is refused before anything starts."""
    from kiln.stack import EmbeddedStack

    stack = EmbeddedStack(home=tmp_path, port=1, pool="solo")
    stack._env = {"PATH": "/usr/bin", "KILN_SECRET_KEY": "s"}
    stack.worker_token = "w"
    argv, env = stack._worker_command("second", pool="prefork", concurrency=2,
                                      fingerprint_file="fp.json")
    assert argv[1:] == ["-m", "compiler_worker", "worker", "--name", "second",
                        "--pool", "prefork", "--concurrency", "2"]
    assert env["KILN_FINGERPRINT_FILE"] == str(Path("fp.json").resolve())
    assert env["KILN_WORKER_TOKEN"] == "w" and "KILN_SECRET_KEY" not in env
    argv, env = stack._worker_command("third", pool="solo")
    assert argv[-2:] == ["--pool", "solo"] and "KILN_FINGERPRINT_FILE" not in env
    with pytest.raises(ValueError, match="prefork, solo; got 'threads'"):
        stack._worker_command("fourth", pool="threads")

def test_several_api_processes_recheck_desired_state_ten_times_a_second(tmp_path: Path) -> None:
    """A deployment made through one API process reaches the long-polls another holds through
    the re-check: with several processes it looks every 0.1 s unless told otherwise."""
    assert KilnSettings(home=tmp_path).desired_state_recheck_s == 1.0
    assert KilnSettings(home=tmp_path, api_processes=2).desired_state_recheck_s == 0.1
    assert KilnSettings(home=tmp_path, api_processes=4,
                        desired_state_recheck_s=0.5).desired_state_recheck_s == 0.5

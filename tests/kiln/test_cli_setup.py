"""Set-up commands and start-up refusals, as processes: ``kiln keygen``, ``kiln store init``,
and ``kiln api`` / ``kiln worker`` stopping on a loose key file, an unreachable broker or a
missing bucket, each naming the fix."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import boto3
import pytest

from artifact_store.signing import load_signer
from kiln.exit_codes import EXIT_CODES
from schemas.errors import ConfigError, ErrorCode
from tests.conftest import free_port

SECRET = "test-secret-0123456789abcdef-0123456789"
CONFIG = EXIT_CODES[ErrorCode.CONFIG_ERROR]


def kiln(*args: str, env: dict[str, str], cwd: Path, timeout: float = 120):
    # Nothing of this process's settings or store credentials leaks in: the S3 fixtures of
    # other tests put AWS_* into os.environ for the rest of the session.
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KILN_", "AWS_"))}
    return subprocess.run([sys.executable, "-m", "kiln.cli", *args], env={**base, **env},
                          cwd=cwd, capture_output=True, text=True, timeout=timeout)


def dev_env(tmp_path: Path, **more: str) -> dict[str, str]:
    return {"KILN_ENV": "dev", "KILN_SECRET_KEY": SECRET, "KILN_HOME": str(tmp_path / "home"),
            **more}


def test_keygen_writes_a_private_key_only_its_owner_reads_and_never_overwrites(
        tmp_path: Path) -> None:
    out = tmp_path / "keys"
    first = kiln("keygen", "--out", str(out), env={}, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    private, public = out / "signing.key", out / "signing.key.pub"
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert public.read_bytes().startswith(b"-----BEGIN PUBLIC KEY-----")
    key_id = load_signer(private).key_id
    assert key_id in first.stderr and first.stdout.strip() == str(private.resolve())

    again = kiln("keygen", "--out", str(out), env={}, cwd=tmp_path)
    assert again.returncode == EXIT_CODES[ErrorCode.CONFLICT], again.stderr
    assert "--force" in again.stderr and load_signer(private).key_id == key_id

    replaced = kiln("keygen", "--out", str(out), "--force", env={}, cwd=tmp_path)
    assert replaced.returncode == 0, replaced.stderr
    assert load_signer(private).key_id != key_id
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert sorted(p.name for p in out.iterdir()) == ["signing.key", "signing.key.pub"]


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644])
def test_a_private_key_others_can_read_is_refused_naming_chmod(tmp_path: Path, mode: int) -> None:
    kiln("keygen", "--out", str(tmp_path), env={}, cwd=tmp_path)
    key = tmp_path / "signing.key"
    key.chmod(mode)
    with pytest.raises(ConfigError, match=rf"mode 0{mode:o}.*chmod 600 {key}"):
        load_signer(key)


def test_the_worker_needs_no_signing_key_but_refuses_to_start_without_a_worker_token(
        tmp_path: Path) -> None:
    # A signing key others can read is no concern of a worker's: it never reads one.
    kiln("keygen", "--out", str(tmp_path / "home"), env={}, cwd=tmp_path)
    (tmp_path / "home" / "signing.key").chmod(0o644)
    proc = kiln("worker", "--pool", "solo", env=dev_env(tmp_path), cwd=tmp_path)
    assert proc.returncode == CONFIG, proc.stderr
    message = proc.stderr.replace("\n", "")
    assert "KILN_WORKER_TOKEN" in message and "KILN_WORKER_API_URL" in message
    assert "chmod" not in message


def test_a_worker_refuses_control_plane_secrets_in_its_environment(tmp_path: Path) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    worker_env = {"KILN_HOME": str(tmp_path / "home"), "KILN_BROKER_URL": dead,
                  "KILN_WORKER_API_URL": "http://127.0.0.1:9", "KILN_WORKER_TOKEN": "t"}
    leaked = {"KILN_DATABASE_URL": "postgresql+psycopg://kiln:pw@db/kiln",
              "AWS_SECRET_ACCESS_KEY": "s3-secret", "KILN_SECRET_KEY": SECRET}
    proc = kiln("worker", "--pool", "solo", env={**worker_env, **leaked}, cwd=tmp_path)
    assert proc.returncode == CONFIG, proc.stderr
    message = proc.stderr.replace("\n", "")
    for name in leaked:
        assert name in message
    assert "pw" not in message and "s3-secret" not in message  # named, never shown
    # In dev it is a warning; the worker goes on (here to the broker, which is down).
    proc = kiln("worker", "--pool", "solo",
                env={**worker_env, **leaked, "KILN_ENV": "dev"}, cwd=tmp_path)
    assert proc.returncode == CONFIG, proc.stderr
    message = proc.stderr.replace("\n", "")
    assert "holds no control-plane secret" in message and "does not answer" in message
    # With only what a worker needs, production starts as far as the broker.
    proc = kiln("worker", "--pool", "solo", env=worker_env, cwd=tmp_path)
    assert proc.returncode == CONFIG and "does not answer" in proc.stderr.replace("\n", "")


def test_the_api_refuses_to_start_when_the_broker_does_not_answer(tmp_path: Path) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    proc = kiln("api", "--port", str(free_port()),
                env=dev_env(tmp_path, KILN_BROKER_URL=dead), cwd=tmp_path)
    assert proc.returncode == CONFIG, proc.stderr
    message = proc.stderr.replace("\n", "")
    assert "does not answer" in message and "KILN_BROKER_URL" in message and dead in message


def test_a_missing_bucket_stops_the_api_and_store_init_creates_it(
        tmp_path: Path, s3_endpoint: str) -> None:
    bucket = f"kiln-init-{os.urandom(4).hex()}"
    env = dev_env(tmp_path, KILN_STORE_URI=f"s3://{bucket}/artifacts",
                  KILN_S3_ENDPOINT_URL=s3_endpoint, AWS_ACCESS_KEY_ID="testing",
                  AWS_SECRET_ACCESS_KEY="testing")
    refused = kiln("api", "--port", str(free_port()), env=env, cwd=tmp_path)
    assert refused.returncode == CONFIG, refused.stderr
    assert "does not exist" in refused.stderr and "kiln store init" in refused.stderr

    init = kiln("store", "init", "--json", env=env, cwd=tmp_path)
    assert init.returncode == 0, init.stderr
    assert json.loads(init.stdout) == {"store": f"s3://{bucket}/artifacts", "writable": True}
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    assert bucket in [b["Name"] for b in s3.list_buckets()["Buckets"]]
    # the probe object was deleted again
    assert s3.list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0
    again = kiln("store", "init", env=env, cwd=tmp_path)  # idempotent
    assert again.returncode == 0 and "is ready" in again.stderr


def test_store_init_makes_a_local_folder_and_names_an_unreachable_endpoint(
        tmp_path: Path) -> None:
    folder = tmp_path / "deep" / "store"
    ok = kiln("store", "init", env=dev_env(tmp_path, KILN_STORE_URI=folder.as_uri()),
              cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert folder.is_dir() and not any(p.is_file() for p in folder.rglob("*"))  # probe gone
    down = f"http://127.0.0.1:{free_port()}"
    failed = kiln("store", "init", env=dev_env(
        tmp_path, KILN_STORE_URI="s3://b/p", KILN_S3_ENDPOINT_URL=down,
        AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="y"), cwd=tmp_path)
    assert failed.returncode == EXIT_CODES[ErrorCode.STORE_ERROR], failed.stderr
    assert down in failed.stderr.replace("\n", "")


def test_store_commands_in_production_need_the_store_named(tmp_path: Path) -> None:
    proc = kiln("store", "verify", env={"KILN_SECRET_KEY": SECRET,
                                        "KILN_HOME": str(tmp_path / "home")}, cwd=tmp_path)
    assert proc.returncode == CONFIG, proc.stderr
    assert "KILN_STORE_URI" in proc.stderr and not (tmp_path / "home" / "store").exists()

"""The sandbox with a real worker process (embedded stack): a job whose build runs out of the
child's address space fails ``resource_limit`` and the same worker builds the next job; a
hostile plugin's probe of the worker's secrets comes back empty, and the signing key appears
in no job error and no log."""

from __future__ import annotations

import json
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from compiler_worker.benchmark import default_lock_path
from schemas.jobs import JobStatus
from tests.compiler_worker.helpers import fast_options
from tests.compiler_worker.test_sandbox import inflating_model
from tests.integration.conftest import RunningStack, _start
from tests.plugins.helpers import SCALE_MODULE, pack, scale_model, scale_plugin, unique_domain

pytestmark = pytest.mark.integration

BUILD_TIMEOUT_S = 45
#: The wall clock of the stack whose build runs past it: waited out in full, so shorter, yet
#: long enough for the untuned build after it on a loaded machine.
SHORT_CLOCK_S = 20

#: A plugin whose shape function reports, in its error, what the module could reach.
PROBE = '''
import json, os
from pathlib import Path

def _try(action):
    try:
        return "ok: " + str(action())
    except Exception as exc:
        return "refused: " + type(exc).__name__

_parent = os.getppid()
PROBE = {
    "env": sorted(os.environ),
    "signing_key": _try(lambda: Path(SIGNING_KEY).read_text()),
    "database": _try(lambda: Path(DATABASE).read_bytes()[:64]),
    "parent_environ": _try(lambda: Path(f"/proc/{_parent}/environ").read_bytes()),
    "write_outside": _try(lambda: Path(OUTSIDE).write_text("planted")),
}

def shape(inputs, attributes):
    raise ValueError("probe=" + json.dumps(PROBE))
'''


def onnx_keys(stack: RunningStack) -> list[str]:
    """The onnxruntime key of the stack's worker: one job per test (its worker serves other
    keys too, and another backend that takes ONNX models would make a second job)."""
    keys = [k for k in stack.client.live_fingerprint_keys("onnx") if k.startswith("ort-")]
    assert len(keys) == 1, stack.client.live_fingerprint_keys("onnx")
    return keys


def _sandboxed_stack(request: pytest.FixtureRequest, tmp_path: Path,
                     monkeypatch: pytest.MonkeyPatch, timeout_s: int,
                     **overrides: str) -> Iterator[RunningStack]:
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "kiln"))
    yield from _start(request, tmp_path, "embedded",
                      {"KILN_SANDBOX_MEMORY_BYTES": str(2 << 30),
                       "KILN_SANDBOX_TIMEOUT_S": str(timeout_s), **overrides})


@pytest.fixture
def stack(request: pytest.FixtureRequest, tmp_path: Path,
          monkeypatch: pytest.MonkeyPatch) -> Iterator[RunningStack]:
    """The embedded stack whose worker builds in a child of 2 GiB of address space, for at
    most ``BUILD_TIMEOUT_S``."""
    yield from _sandboxed_stack(request, tmp_path, monkeypatch, BUILD_TIMEOUT_S)


@pytest.fixture
def short_clock_stack(request: pytest.FixtureRequest, tmp_path: Path,
                      monkeypatch: pytest.MonkeyPatch) -> Iterator[RunningStack]:
    """``stack`` with a wall clock of ``SHORT_CLOCK_S``, and a benchmark lock of its own: the
    clock runs while a build waits for the host's lock, which another test process's tuning
    may hold. (Outside ``/tmp``, which a sandboxed build sees as its own.)"""
    lock = default_lock_path().parent / f"kiln-test-{uuid.uuid4().hex}.lock"
    try:
        yield from _sandboxed_stack(request, tmp_path, monkeypatch, SHORT_CLOCK_S,
                                    KILN_BENCHMARK_LOCK=str(lock))
    finally:
        lock.unlink(missing_ok=True)


def test_a_build_past_the_memory_limit_fails_typed_and_the_worker_builds_the_next(stack):
    client = stack.client
    options = fast_options()
    bad = client.upload_model(inflating_model().SerializeToString()).id
    (job,) = client.create_jobs(bad, onnx_keys(stack), options)
    job = client.wait_job(job.id, timeout_s=300)
    assert job.status is JobStatus.FAILED, job
    assert job.error.code == "resource_limit", job.error
    assert job.error.details["limit"] == "address_space"
    assert job.error.details["stage"] in {"building", "verifying"}
    assert client.list_artifacts() == []

    from kiln.examples import mlp

    (good,) = client.create_jobs(client.upload_model(mlp().SerializeToString()).id,
                                 onnx_keys(stack), options)
    good = client.wait_job(good.id, timeout_s=300)
    assert good.status is JobStatus.SUCCEEDED, good.error
    assert good.worker == job.worker and good.attempts == job.attempts == 1


def test_a_hostile_plugin_reaches_none_of_the_worker_secrets(stack, tmp_path: Path):
    home = stack.home
    signing_key = home / "signing.key"
    key_text = signing_key.read_text()
    key_body = "".join(line for line in key_text.splitlines() if "-----" not in line)
    outside = tmp_path / "planted.txt"
    domain = unique_domain()
    probe = textwrap.dedent(PROBE).replace("SIGNING_KEY", repr(str(signing_key))).replace(
        "DATABASE", repr(str(home / "kiln.db"))).replace("OUTSIDE", repr(str(outside)))
    module = SCALE_MODULE + probe
    bundle = pack(scale_plugin(tmp_path / "hostile", domain=domain, module=module),
                  tmp_path / "hostile.tar")
    client = stack.client
    client.push_plugin(bundle.archive)
    model = client.upload_model(scale_model(domain).SerializeToString()).id
    (job,) = client.create_jobs(model, onnx_keys(stack), fast_options())
    job = client.wait_job(job.id, timeout_s=300)

    assert job.status is JobStatus.FAILED and job.error.code == "plugin_error", job
    probe, _ = json.JSONDecoder().raw_decode(job.error.message.split("probe=", 1)[1])
    assert not [name for name in probe["env"] if name.startswith(("KILN_", "AWS_"))], probe
    for attempt in ("signing_key", "database", "parent_environ", "write_outside"):
        assert probe[attempt].startswith("refused"), (attempt, probe[attempt])
    assert not outside.exists()
    logs = "".join(log.read_text(errors="replace") for log in (home / "logs").glob("*.log"))
    assert "probe=" in logs  # the worker logged the failure ...
    assert key_body not in logs and key_body not in job.error.message  # ... never the key


def test_a_build_past_its_wall_clock_is_stopped_as_timed_out_and_the_worker_serves_on(
        short_clock_stack, tmp_path: Path):
    stack = short_clock_stack
    domain = unique_domain()
    sleepy = SCALE_MODULE + textwrap.dedent("""
        import time

        def shape(inputs, attributes):
            time.sleep(3600)
    """)
    bundle = pack(scale_plugin(tmp_path / "sleepy", domain=domain, module=sleepy),
                  tmp_path / "sleepy.tar")
    client = stack.client
    client.push_plugin(bundle.archive)
    model = client.upload_model(scale_model(domain).SerializeToString()).id
    (job,) = client.create_jobs(model, onnx_keys(stack), fast_options())
    job = client.wait_job(job.id, timeout_s=SHORT_CLOCK_S + 120)
    assert job.status is JobStatus.FAILED, job
    assert job.error.code == "timed_out", job.error
    assert job.error.details["limit_s"] == SHORT_CLOCK_S
    assert job.error.details["stage"] in {"checking", "optimizing"}, job.error.details

    from kiln.examples import mlp

    (good,) = client.create_jobs(client.upload_model(mlp().SerializeToString()).id,
                                 onnx_keys(stack), fast_options())
    good = client.wait_job(good.id, timeout_s=300)
    assert good.status is JobStatus.SUCCEEDED, good.error
    assert good.worker == job.worker

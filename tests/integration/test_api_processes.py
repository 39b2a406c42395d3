"""`kiln api` with several processes (``KILN_API_PROCESSES``) on PostgreSQL: the processes
share the port; a deployment made through one reaches the long-polls every process holds
within the re-check (0.1 s by default with several processes), and a SIGTERM answers the held
long-polls at once instead of waiting a minute for them."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from kiln.examples import mlp
from kiln.stack import EmbeddedStack
from tests.integration.conftest import running_stack
from tests.services.api.conftest import registration

pytestmark = pytest.mark.integration

KEY = "ort-cpu-x86-64-v3-ort1.32"
#: Held long-polls: with two processes accepting on one socket, all sixteen land on the same
#: one about once in 30,000 runs.
AGENTS = 16


@pytest.fixture
def stack(request, tmp_path: Path, postgres_url: str, redis_url: str) -> Iterator[EmbeddedStack]:
    yield from running_stack(request, tmp_path, workers=0, overrides={
        "KILN_DATABASE_URL": postgres_url, "KILN_BROKER_URL": redis_url,
        "KILN_API_PROCESSES": "2"})


def serving_processes(stack: EmbeddedStack) -> list[psutil.Process]:
    """The processes uvicorn spawned to serve the port."""
    parent = psutil.Process(stack.processes[0].pid)
    return [p for p in parent.children(recursive=True)
            if "spawn_main" in " ".join(p.cmdline()) and "resource_tracker" not in
            " ".join(p.cmdline())]


def test_a_deployment_through_one_process_reaches_the_long_polls_all_processes_hold(stack):
    children = serving_processes(stack)
    assert len(children) == 2
    # No fleet port: nothing to put first, so every process keeps the parent's priority.
    parent = psutil.Process(stack.processes[0].pid)
    assert [p.nice() for p in children] == [parent.nice()] * 2
    headers = {"Authorization": f"Bearer {stack.token}"}
    with httpx.Client(base_url=stack.api_url, headers=headers, timeout=30) as api:
        model_id = api.post("/v1/models", files={"file": ("mlp.onnx", mlp().SerializeToString())}
                            ).raise_for_status().json()["id"]
        digests = {}
        for i in range(AGENTS):
            name = f"n{i:02d}"
            api.post("/v1/agents", json=registration(name, KEY, {"site": "a"})
                     ).raise_for_status()
            digests[name] = api.get(f"/v1/agents/{name}/desired-state").headers["ETag"].strip('"')

        answered: dict[str, tuple[int, float]] = {}

        def hold(name: str) -> None:
            # One connection each, so the kernel spreads them over the processes.
            with httpx.Client(base_url=stack.api_url, headers=headers, timeout=40) as own:
                r = own.get(f"/v1/agents/{name}/desired-state",
                            params={"after": digests[name], "wait": 30})
                answered[name] = (r.status_code, time.monotonic())

        threads = [threading.Thread(target=hold, args=(n,)) for n in digests]
        for thread in threads:
            thread.start()
        time.sleep(1.5)  # every long-poll held
        assert answered == {}
        deployed = time.monotonic()
        api.post("/v1/deployments", json={"name": "d", "model_id": model_id,
                                          "selector": {"site": "a"}}).raise_for_status()
        for thread in threads:
            thread.join(20)
    assert sorted(answered) == sorted(digests)
    assert {status for status, _ in answered.values()} == {200}
    # Answered by the change, in every process, not by the 30 s wait running out. How soon is
    # a figure for bench/desired_state.py; a tight bound here only measured the CI machine's
    # load.
    slowest = max(at for _, at in answered.values()) - deployed
    assert slowest < 10, f"the last held long-poll answered {slowest:.2f} s after the deployment"


def test_sigterm_answers_held_long_polls_and_stops_every_process(stack):
    headers = {"Authorization": f"Bearer {stack.token}"}
    with httpx.Client(base_url=stack.api_url, headers=headers, timeout=30) as api:
        api.post("/v1/agents", json=registration("n1", KEY)).raise_for_status()
        digest = api.get("/v1/agents/n1/desired-state").headers["ETag"].strip('"')
    answers: list[int | str] = []

    def hold() -> None:
        try:
            with httpx.Client(base_url=stack.api_url, headers=headers, timeout=40) as own:
                answers.append(own.get("/v1/agents/n1/desired-state",
                                       params={"after": digest, "wait": 60}).status_code)
        except httpx.HTTPError as exc:
            answers.append(repr(exc))

    threads = [threading.Thread(target=hold) for _ in range(6)]
    for thread in threads:
        thread.start()
    time.sleep(3.0)  # every long-poll is held (a busy machine takes its time to connect)
    children = serving_processes(stack)
    started = time.monotonic()
    os.killpg(stack.processes[0].pid, 15)
    stack.processes[0].wait(20)
    for thread in threads:
        thread.join(20)
    assert time.monotonic() - started < 10
    assert answers == [204] * 6, answers
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in children)


@pytest.fixture
def fleet_port_stack(request, tmp_path: Path, postgres_url: str,
                     redis_url: str) -> Iterator[tuple[EmbeddedStack, str]]:
    from tests.conftest import free_port

    agent_port = free_port()
    for stack in running_stack(request, tmp_path, workers=0, overrides={
            "KILN_DATABASE_URL": postgres_url, "KILN_BROKER_URL": redis_url,
            "KILN_API_PROCESSES": "1", "KILN_API_AGENT_PORT": str(agent_port),
            "KILN_API_AGENT_PROCESSES": "1"}):
        yield stack, f"http://{stack.host}:{agent_port}"


def test_the_fleet_port_has_processes_of_its_own_and_hears_of_changes_at_once(
        fleet_port_stack):
    """``KILN_API_AGENT_PORT``: a process of its own serves the agents' port, at the
    parent's priority while the API's port is served ``KILN_API_NICE`` (5) lower; a long-poll
    held there is answered when a deployment is made through the API's port (the re-check
    runs every 0.1 s with a fleet port), and SIGTERM stops both."""
    stack, agents_url = fleet_port_stack
    children = serving_processes(stack)
    by_port = {c.laddr.port: p for p in children for c in p.net_connections("tcp")
               if c.status == psutil.CONN_LISTEN}
    agent_port = int(agents_url.rsplit(":", 1)[1])
    assert len(children) == 2 and sorted(by_port) == sorted([stack.port, agent_port])
    parent_nice = psutil.Process(stack.processes[0].pid).nice()
    assert by_port[agent_port].nice() == parent_nice
    assert by_port[stack.port].nice() == min(19, parent_nice + 5)
    # Every thread of the API's process runs at that priority (Linux sets it per thread,
    # and the threads started after the process lowered its own inherit it). A thread that
    # ends between the listing and the look (the revocation list's reader) is skipped.
    nices = set()
    for thread in by_port[stack.port].threads():
        with contextlib.suppress(ProcessLookupError):
            nices.add(os.getpriority(os.PRIO_PROCESS, thread.id))
    assert nices == {min(19, parent_nice + 5)}
    headers = {"Authorization": f"Bearer {stack.token}"}
    with httpx.Client(base_url=stack.api_url, headers=headers, timeout=30) as api, \
            httpx.Client(base_url=agents_url, headers=headers, timeout=40) as fleet:
        model_id = api.post("/v1/models", files={"file": ("mlp.onnx", mlp().SerializeToString())}
                            ).raise_for_status().json()["id"]
        fleet.post("/v1/agents", json=registration("n1", KEY, {"site": "a"})).raise_for_status()
        digest = fleet.get("/v1/agents/n1/desired-state").headers["ETag"].strip('"')
        answered: list[tuple[int, float]] = []

        def hold() -> None:
            r = fleet.get("/v1/agents/n1/desired-state", params={"after": digest, "wait": 30})
            answered.append((r.status_code, time.monotonic()))

        thread = threading.Thread(target=hold)
        thread.start()
        time.sleep(1.5)
        assert answered == []
        deployed = time.monotonic()
        api.post("/v1/deployments", json={"name": "d", "model_id": model_id,
                                          "selector": {"site": "a"}}).raise_for_status()
        thread.join(20)
    assert [status for status, _ in answered] == [200]
    # Heard at the next re-check, not at the end of the 30 s wait. The bound includes the
    # deployment's own request and leaves room for a loaded host: a tight one failed while
    # four test processes shared two cores, the mechanism working.
    assert answered[0][1] - deployed < 5
    os.killpg(stack.processes[0].pid, 15)
    stack.processes[0].wait(20)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in children)

"""A change that wakes a thousand long-polls at once: their answers are paced on the event loop
(``LoopPace``), so requests that arrive meanwhile are served between them, and agents of one
profile wait for one computation of it (``DesiredStateHub.recompute``) instead of taking a
thread each. Also the API's thread pools (``services.api.threads``)."""

from __future__ import annotations

import asyncio
import threading
import time

import anyio
import anyio.to_thread
import pytest
from fastapi.testclient import TestClient

from services.api.app import create_app
from services.api.desired import DesiredStateHub, LoopPace
from services.api.fleet import AgentProfile
from services.api.threads import run_desired, run_slow


class Passes:
    """Counts the passes of the running loop: a callback that schedules itself again runs
    once per pass."""

    def __init__(self) -> None:
        self.count = 0
        self._stopped = False

    def start(self) -> None:
        asyncio.get_running_loop().call_soon(self._tick)

    def _tick(self) -> None:
        self.count += 1
        if not self._stopped:
            asyncio.get_running_loop().call_soon(self._tick)

    def stop(self) -> None:
        self._stopped = True


@pytest.mark.parametrize("per_pass", [1, 4])
def test_at_most_per_pass_turns_go_on_in_one_pass_in_order(per_pass):
    async def scenario() -> list[tuple[int, int]]:
        pace, passes, went = LoopPace(asyncio.get_running_loop(), per_pass), Passes(), []
        passes.start()

        async def one(i: int) -> None:
            await pace.turn()
            went.append((i, passes.count))

        await asyncio.gather(*(one(i) for i in range(20)))
        passes.stop()
        return went

    went = asyncio.run(scenario())
    assert [i for i, _ in went] == list(range(20)), "turns are given in the order asked"
    per = {}
    for _, at in went:
        per[at] = per.get(at, 0) + 1
    assert max(per.values()) <= per_pass, f"more than {per_pass} turns in one pass: {per}"


@pytest.mark.parametrize(("per_pass", "paced"), [(4, True), (10_000, False)])
def test_a_request_arriving_during_a_burst_goes_between_its_turns(per_pass, paced):
    """500 answers waiting for turns, then a heartbeat-like task: paced, it runs after a few
    of them; unpaced (one pass for all), after every one."""

    async def scenario() -> int:
        pace, done = LoopPace(asyncio.get_running_loop(), per_pass), []

        async def answer(i: int) -> None:
            await pace.turn()
            done.append(i)

        burst = [asyncio.create_task(answer(i)) for i in range(500)]
        await asyncio.sleep(0)  # the burst asked for its turns
        seen: list[int] = []

        async def heartbeat() -> None:
            seen.append(len(done))

        await asyncio.create_task(heartbeat())
        await asyncio.gather(*burst)
        return seen[0]

    answered_before = asyncio.run(scenario())
    if paced:
        assert answered_before <= 3 * per_pass, f"{answered_before} answers went first"
    else:
        assert answered_before == 500


def test_a_cancelled_turn_is_skipped():
    async def scenario() -> list[int]:
        pace, went = LoopPace(asyncio.get_running_loop(), 1), []

        async def one(i: int) -> None:
            await pace.turn()
            went.append(i)

        tasks = [asyncio.create_task(one(i)) for i in range(6)]
        await asyncio.sleep(0)
        tasks[2].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return went

    assert asyncio.run(scenario()) == [0, 1, 3, 4, 5]


def profile(site: str) -> AgentProfile:
    return AgentProfile(labels={"site": site}, fingerprint_keys={"onnxruntime": "k"},
                        compatibility_keys={})


async def in_thread(fn):
    return await asyncio.to_thread(fn)


def test_agents_of_one_profile_wait_for_one_computation():
    """50 woken long-polls of one profile and 50 of another: two computations in threads; the
    rest find the result kept. An agent whose profile is not known yet computes its own."""
    hub = DesiredStateHub(cache_s=60)
    names = [f"a{i}" for i in range(50)] + [f"b{i}" for i in range(50)]
    for name in names:
        hub.profile(name, lambda n=name: profile(n[0]))
    kept: dict[str, str] = {}
    computed: list[str] = []
    gate = threading.Event()

    def compute_for(name: str):
        def compute() -> str:
            gate.wait(5)  # every long-poll has asked before the first computation ends
            computed.append(name)
            kept[name[0]] = f"models of {name[0]}"
            return kept[name[0]]
        return compute

    async def scenario() -> list[str]:
        tasks = [asyncio.create_task(hub.recompute(
            n, compute_for(n), lambda n=n: kept.get(n[0]), in_thread)) for n in names]
        tasks.append(asyncio.create_task(hub.recompute(
            "stranger", compute_for("stranger"), lambda: None, in_thread)))
        await asyncio.sleep(0.05)
        gate.set()
        return await asyncio.gather(*tasks)

    answers = asyncio.run(scenario())
    assert answers[:50] == ["models of a"] * 50 and answers[50:100] == ["models of b"] * 50
    assert sorted(n[0] for n in computed) == ["a", "b", "s"], computed
    assert (hub.recomputed, hub.shared) == (3, 98)


def test_a_failed_computation_is_not_shared():
    """The computation of a profile fails: its owner gets the error; the others waiting for
    it compute again (one of them at a time), and none gets a result that was not kept."""
    hub = DesiredStateHub(cache_s=60)
    for name in ("a0", "a1", "a2"):
        hub.profile(name, lambda: profile("a"))
    kept: dict[str, str] = {}
    calls: list[str] = []

    def compute_for(name: str):
        def compute() -> str:
            calls.append(name)
            if len(calls) == 1:
                raise RuntimeError("the database went away")
            kept["a"] = "models"
            return "models"
        return compute

    async def scenario():
        return await asyncio.gather(*(hub.recompute(n, compute_for(n), lambda: kept.get("a"),
                                                    in_thread) for n in ("a0", "a1", "a2")),
                                    return_exceptions=True)

    first, *rest = asyncio.run(scenario())
    assert isinstance(first, RuntimeError)
    assert rest == ["models", "models"]
    assert len(calls) == 2, calls


def test_the_api_sizes_its_thread_pools_from_the_settings(settings):
    app = create_app(settings.model_copy(update={
        "api_threads": 3, "api_slow_threads": 2, "api_desired_state_threads": 1}))

    async def sizes() -> tuple[float, float, float]:
        return (anyio.to_thread.current_default_thread_limiter().total_tokens,
                app.state.slow_threads.total_tokens, app.state.desired_threads.total_tokens)

    with TestClient(app) as client:
        assert client.portal.call(sizes) == (3, 2, 1)


def test_desired_state_computations_run_a_few_at_a_time():
    """A deployment wakes many profiles' long-polls at once: their computations go through
    their own small pool, at most its size at once, and leave the short pool free."""
    from fastapi import FastAPI
    from starlette.requests import Request

    app = FastAPI()
    request = Request({"type": "http", "app": app})
    running, most = [0], [0]
    lock = threading.Lock()

    def compute() -> str:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        return "models"

    async def scenario() -> list[str]:
        anyio.to_thread.current_default_thread_limiter().total_tokens = 1
        app.state.desired_threads = anyio.CapacityLimiter(2)
        results: list[str] = []

        async def one() -> None:
            results.append(await run_desired(request, compute))

        async with anyio.create_task_group() as tg:
            for _ in range(6):
                tg.start_soon(one)
            await anyio.sleep(0.01)
            with anyio.fail_after(2):  # the short pool is free meanwhile
                assert await anyio.to_thread.run_sync(lambda: True)
        return results

    assert anyio.run(scenario) == ["models"] * 6
    assert most[0] == 2


def test_slow_work_never_holds_the_short_pool():
    """With one short thread and one slow one, a slow call that blocks leaves the short pool
    free; the same call through the short pool would have held it."""
    from fastapi import FastAPI
    from starlette.requests import Request

    app = FastAPI()
    request = Request({"type": "http", "app": app})

    async def scenario() -> bool:
        anyio.to_thread.current_default_thread_limiter().total_tokens = 1
        app.state.slow_threads = anyio.CapacityLimiter(1)
        release = threading.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_slow, request, release.wait, 5)
            await anyio.sleep(0.05)
            with anyio.fail_after(2):  # the short pool is free
                ran = await anyio.to_thread.run_sync(lambda: True)
            release.set()
        return ran

    assert anyio.run(scenario) is True

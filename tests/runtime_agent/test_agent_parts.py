"""The agent is one class made of parts in their own modules: ``Agent`` (life cycle, readiness),
``Reconciler`` (control loop, long-poll, reconcile) and ``Gates`` (what an engine passes before
it serves)."""

from __future__ import annotations

import inspect
from pathlib import Path

import runtime_agent
from runtime_agent.agent import Agent
from runtime_agent.gates import Gates
from runtime_agent.reconcile import Reconciler

PARTS = (Agent, Reconciler, Gates)


def _defined(cls: type) -> set[str]:
    return {name for name, obj in vars(cls).items()
            if inspect.isfunction(obj) and name not in ("__init__", "__enter__", "__exit__")}


def test_the_parts_define_each_method_once() -> None:
    # Agent inherits both parts: a method two of them define would be taken from the first in
    # the method order, and the other silently never run.
    seen: dict[str, str] = {}
    for part in PARTS:
        for name in _defined(part):
            assert name not in seen, f"{name} is defined by {seen[name]} and {part.__name__}"
            seen[name] = part.__name__
    assert Agent.__mro__[1:4] == (Reconciler, Gates, object)


def test_no_runtime_agent_module_grows_past_600_lines() -> None:
    folder = Path(runtime_agent.__file__).parent
    # The gRPC stubs (*_pb2*.py) are generated, not written.
    sizes = {str(path.relative_to(folder)): len(path.read_text().splitlines())
             for path in folder.rglob("*.py") if "_pb2" not in path.name}
    assert max(sizes.values()) <= 600, {k: v for k, v in sizes.items() if v > 600}

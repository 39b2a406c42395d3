"""The control-plane stub serves a whole test session: what one test sets on it must not reach
the next. A 60 s heartbeat left behind once made a later agent test wait a minute per change."""
from __future__ import annotations

from dataclasses import fields

from tests.runtime_agent.helpers import ControlPlaneStub


def test_reset_restores_every_setting_but_the_address() -> None:
    stub = ControlPlaneStub(url="http://127.0.0.1:1")
    stub.heartbeat_s = 60.0
    stub.expires_in_s = 1.0
    stub.serve_instead = b"{}"
    stub.tampered.add("a")
    stub.issued.append(b"{}")
    stub.reset()
    fresh = ControlPlaneStub()
    changed = [f.name for f in fields(stub)
               if f.name != "url" and getattr(stub, f.name) != getattr(fresh, f.name)]
    assert changed == []
    assert stub.url == "http://127.0.0.1:1"

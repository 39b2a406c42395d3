"""Agent liveness (``AGENT_TTL``): an agent silent for longer is not alive, and a deployment
queues no builds for it; one heard from within it is, and does."""

from __future__ import annotations

from datetime import timedelta

import sqlalchemy as sa

from kiln.examples import mlp
from services.db import make_engine, make_session_factory, repo, session_scope
from services.db.tables import AgentRow, utcnow
from tests.services.api.test_api import upload
from tests.services.api.test_fleet import deploy, register


def _silent_for(settings, name: str, age: timedelta) -> None:
    factory = make_session_factory(make_engine(settings.database_url))
    with session_scope(factory) as session:
        session.execute(sa.update(AgentRow).where(AgentRow.name == name)
                        .values(last_seen=utcnow() - age))


def test_an_agent_silent_past_the_ttl_is_not_alive_and_gets_no_builds(api, settings):
    model_id = upload(api, mlp().SerializeToString()).json()["id"]
    register(api, "quiet", {"site": "a"})
    register(api, "recent", {"site": "b"}, key="ort-cpu-x86-64-v4-ort1.32")
    _silent_for(settings, "quiet", repo.AGENT_TTL + timedelta(seconds=5))
    _silent_for(settings, "recent", repo.AGENT_TTL - timedelta(seconds=10))

    alive = {a["name"]: a["alive"] for a in api.get("/v1/agents").json()}
    assert alive == {"quiet": False, "recent": True}

    quiet = deploy(api, "to-quiet", model_id, {"site": "a"})
    assert quiet.status_code == 201 and quiet.json()["build_jobs"] == []
    recent = deploy(api, "to-recent", model_id, {"site": "b"})
    assert len(recent.json()["build_jobs"]) == 1

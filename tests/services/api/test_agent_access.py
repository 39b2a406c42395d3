"""An agent token reads what its agent needs and nothing more: the artifacts of its desired
state (and the plugins they name), and its own record; never another agent's artifacts or
record, nor lists of either."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.examples import mlp, small_cnn
from services.api.auth import Role
from tests.services.api.conftest import bearer, make_settings, registration
from tests.services.api.test_api import upload
from tests.services.api.test_fleet import KEY, deploy, record


@pytest.fixture
def settings(tmp_path: Path):
    return make_settings(tmp_path, desired_state_cache_s=0)  # artifacts recorded behind its back


def test_an_agent_reads_only_its_desired_artifacts_and_its_own_record(api, settings):
    a = {"Authorization": bearer(Role.AGENT, agent="node-a")}
    b = {"Authorization": bearer(Role.AGENT, agent="node-b")}
    for name, site, headers in (("node-a", "a", a), ("node-b", "b", b)):
        answer = api.post("/v1/agents", json=registration(name, KEY, {"site": site}),
                          headers=headers)
        assert answer.status_code == 200, answer.text
    model_a = upload(api, mlp().SerializeToString(), name="a").json()["id"]
    model_b = upload(api, small_cnn().SerializeToString(), name="b").json()["id"]
    assert deploy(api, "svc-a", model_a, {"site": "a"}).status_code == 201
    assert deploy(api, "svc-b", model_b, {"site": "b"}).status_code == 201
    artifact_a, artifact_b = record(settings, model_a), record(settings, model_b)

    # Its own engine: described, and its tuning asked for (404: none recorded, not 403).
    assert api.get(f"/v1/artifacts/{artifact_a}", headers=a).status_code == 200
    assert api.get(f"/v1/artifacts/{artifact_a}/tuning", headers=a).status_code == 404
    # Another node's engine: refused on every route that reads it, saying why.
    for path in (f"/v1/artifacts/{artifact_b}", f"/v1/artifacts/{artifact_b}/manifest",
                 f"/v1/artifacts/{artifact_b}/blobs/engine",
                 f"/v1/artifacts/{artifact_b}/tuning"):
        refused = api.get(path, headers=a)
        assert refused.status_code == 403, (path, refused.text)
        message = refused.json()["message"]
        assert "not in the desired state of agent 'node-a'" in message and artifact_a in message
    assert api.get(f"/v1/artifacts/{artifact_b}", headers=b).status_code == 200
    assert api.get("/v1/artifacts", headers=a).status_code == 403
    # An admin (and a reader) still reads every artifact.
    assert api.get(f"/v1/artifacts/{artifact_b}").status_code == 200
    assert api.get(f"/v1/artifacts/{artifact_b}",
                   headers={"Authorization": bearer(Role.READER)}).status_code == 200

    # Records: its own, not another's, and no listing of the fleet.
    assert api.get("/v1/agents/node-a", headers=a).status_code == 200
    other = api.get("/v1/agents/node-b", headers=a)
    assert other.status_code == 403 and "not agent 'node-b'" in other.json()["message"]
    assert api.get("/v1/agents", headers=a).status_code == 403
    assert api.get("/v1/agents/node-b").status_code == 200

    # Plugins: only those an artifact of its desired state names (these engines name none).
    refused = api.get("/v1/plugins/swish/1.0.0", headers=a)
    assert refused.status_code == 403 and "named by no artifact" in refused.json()["message"]


def test_an_unregistered_agent_reads_no_artifact(api, settings):
    model = upload(api, mlp().SerializeToString(), name="a").json()["id"]
    artifact = record(settings, model)
    ghost = {"Authorization": bearer(Role.AGENT, agent="ghost")}
    refused = api.get(f"/v1/artifacts/{artifact}/manifest", headers=ghost)
    assert refused.status_code == 403 and "not registered" in refused.json()["message"]


def test_an_agent_reads_the_plugins_its_desired_engines_name(api, settings):
    from schemas.plugins import PluginRef
    from services.db import make_engine, make_session_factory, repo, session_scope
    from tests.services.db.helpers import manifest

    a = {"Authorization": bearer(Role.AGENT, agent="node-a")}
    assert api.post("/v1/agents", json=registration("node-a", KEY, {"site": "a"}),
                    headers=a).status_code == 200
    model = upload(api, mlp().SerializeToString(), name="a").json()["id"]
    assert deploy(api, "svc-a", model, {"site": "a"}).status_code == 201
    built = manifest(model, fingerprint_key=KEY).model_copy(update={"plugins": [
        PluginRef(name="swish", version="1.0.0", digest="0" * 64)]})
    with session_scope(make_session_factory(make_engine(settings.database_url))) as session:
        repo.record_artifact(session, model_id=model, manifest=built)
    # Named by its engine: past the check (404: no such plugin was pushed here).
    named = api.get("/v1/plugins/swish/1.0.0", headers=a)
    assert named.status_code == 404, named.text
    assert api.get("/v1/plugins/swish/1.0.0/bundle", headers=a).status_code == 404
    assert api.get("/v1/plugins/swish/2.0.0", headers=a).status_code == 403

"""Deployments, agents and desired state against the API (SQLite, filesystem broker)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from artifact_store.signing import DESIRED_STATE_PAYLOAD_TYPE, TrustedRoot
from kiln.examples import mlp, small_cnn
from schemas.fingerprint import EngineRequirements
from schemas.options import CompileOptions
from services.db import make_engine, make_session_factory, repo, session_scope
from services.signer import root_metadata
from tests.services.api.conftest import make_settings, node_fingerprint, registration
from tests.services.api.test_api import queued_messages, upload
from tests.services.db.helpers import manifest

KEY = "ort-cpu-x86-64-v3-ort1.32"
KEY_V4 = "ort-cpu-x86-64-v4-ort1.32"
FP = node_fingerprint(KEY)


@pytest.fixture
def settings(tmp_path: Path):
    """These tests record artifacts and move builds' backoff straight in the database and
    beat at once: no desired models are kept between requests (the API would see those
    writes only at its next re-check; test_desired_cache.py covers that)."""
    return make_settings(tmp_path, desired_state_cache_s=0)


def signed_state(api, response) -> dict:
    """The desired state in a registration's or heartbeat's answer, once its signature checks
    out against the online key that the API's root metadata names."""
    assert response.status_code == 200, response.text
    trust_dir = Path(api.app.state.settings.trust_dir)
    payload = TrustedRoot(root_metadata(trust_dir)).verify_envelope(
        response.content, DESIRED_STATE_PAYLOAD_TYPE, what="desired state")
    return json.loads(payload)


def beat(api, name: str, models: list | None = None) -> dict:
    return signed_state(api, api.post(f"/v1/agents/{name}/heartbeat",
                                      json={"models": models or []}))


def register(api, name: str, labels: dict[str, str], key: str = KEY):
    response = api.post("/v1/agents", json=registration(name, key, labels))
    return signed_state(api, response)


def deploy(api, name: str, model_id: str, selector: dict[str, str], **options):
    return api.post("/v1/deployments", json={
        "name": name, "model_id": model_id, "selector": selector,
        "options": CompileOptions(**options).model_dump(mode="json"),
    })


def record(settings, model_id: str, key: str = KEY) -> str:
    factory = make_session_factory(make_engine(settings.database_url))
    with session_scope(factory) as session:
        artifact, _ = repo.record_artifact(
            session, model_id=model_id, manifest=manifest(model_id, fingerprint_key=key)
        )
    return artifact.id


def test_deployment_selects_agents_by_label_and_queues_one_build(api, settings):
    model_id = upload(api, mlp().SerializeToString()).json()["id"]
    assert register(api, "edge-1", {"site": "a", "tier": "edge"})["models"] == []
    register(api, "edge-2", {"site": "b"})

    created = deploy(api, "mlp", model_id, {"site": "a"})
    assert created.status_code == 201, created.text
    (job_id,) = created.json()["build_jobs"]
    assert len(queued_messages(settings)) == 1

    state = beat(api, "edge-1")
    (desired,) = state["models"]
    assert desired["deployment"] == "mlp" and desired["artifact_id"] is None
    assert desired["job_id"] == job_id and desired["tier"] == "none"
    assert beat(api, "edge-2")["models"] == []
    # Heartbeats never queue a second build for the same key.
    assert len(queued_messages(settings)) == 1

    artifact_id = record(settings, model_id)
    (desired,) = beat(api, "edge-1")["models"]
    assert desired["artifact_id"] == artifact_id and desired["tier"] == "exact"


def test_agents_report_status_and_deployments_update_and_delete(api):
    model_id = upload(api, mlp().SerializeToString()).json()["id"]
    other = upload(api, small_cnn().SerializeToString()).json()["id"]
    register(api, "node", {"env": "prod"})
    status = {"deployment": "svc", "state": "serving", "artifact_id": "a1", "requests": 3}
    api.post("/v1/agents/node/heartbeat", json={"models": [status]})
    (agent,) = api.get("/v1/agents").json()
    assert agent["alive"] and agent["labels"] == {"env": "prod"}
    assert agent["fingerprint_keys"] == {"onnxruntime": KEY}
    assert agent["models"][0]["state"] == "serving"

    first = deploy(api, "svc", model_id, {"env": "prod"}).json()["deployment"]
    again = deploy(api, "svc", model_id, {"env": "prod"})
    assert again.status_code == 200 and again.json()["deployment"]["generation"] == 1
    changed = deploy(api, "svc", other, {"env": "prod"}).json()["deployment"]
    assert changed["generation"] == 2 and changed["id"] == first["id"]
    assert [d["name"] for d in api.get("/v1/deployments").json()] == ["svc"]
    assert api.delete("/v1/deployments/svc").status_code == 204
    assert api.get("/v1/deployments/svc").status_code == 404
    assert beat(api, "node")["models"] == []


def test_bad_fleet_requests(api):
    assert api.post("/v1/agents/ghost/heartbeat", json={"models": []}).status_code == 404
    bad_label = api.post("/v1/agents", json={
        "name": "n", "labels": {"bad key!": "x"}, "fingerprint": FP.model_dump(mode="json"),
        "fingerprint_keys": {},
    })
    assert bad_label.status_code == 422 and "labels.bad key!" in bad_label.json()["message"]
    unknown_model = deploy(api, "svc", "0" * 64, {})
    assert unknown_model.status_code == 404
    bad_name = deploy(api, "Bad Name", "0" * 64, {})
    assert bad_name.status_code == 422
    assert api.delete("/v1/deployments/nope").status_code == 404


V3, PORTABLE = "ort-cpu-x86-64-v3-ort1.32", "ort-cpu-x86-64-portable-ort1.32"


def v4_worker_and_model(api, settings):
    """A session factory, after a v4 worker that builds portable engines (``PORTABLE``)
    registered, and an uploaded model's id."""
    factory = make_session_factory(make_engine(settings.database_url))
    with session_scope(factory) as session:
        repo.heartbeat_worker(session, name="w-v4", fingerprint_keys=[KEY_V4], fingerprint=FP,
                              portable_keys={KEY_V4: PORTABLE})
    return factory, upload(api, mlp().SerializeToString()).json()["id"]


def record_portable(factory, model_id: str, options: CompileOptions, *,
                    precision: str = "fp32", features: tuple[str, ...] = ()) -> str:
    """Record a portable engine of ``model_id`` built on the v4 worker with ``options``,
    computing in ``precision`` and needing ``features``; its artifact id."""
    built = manifest(model_id, options=options, fingerprint_key=KEY_V4).model_copy(update={
        "compatibility_key": PORTABLE, "precision": precision,
        "requirements": EngineRequirements(arch="x86_64", features=list(features))})
    with session_scope(factory) as session:
        artifact, _ = repo.record_artifact(session, model_id=model_id, manifest=built)
    return artifact.id


def test_tiers_exact_fallback_then_exact_for_a_new_chip_variant(api, settings):
    """A node with an unseen key gets a portable fallback at once and its own engine queued."""
    factory, model_id = v4_worker_and_model(api, settings)
    v3, portable = V3, PORTABLE
    options = CompileOptions()  # level 3: hardware-specific, no compatibility key
    with session_scope(factory) as session:
        repo.record_artifact(session, model_id=model_id, manifest=manifest(
            model_id, options=options, fingerprint_key=KEY_V4))
    deploy(api, "svc", model_id, {})

    def desired(name: str, key: str) -> dict:
        body = registration(name, key)
        assert body["compatibility_keys"] == {"onnxruntime": [portable]}
        (model,) = signed_state(api, api.post("/v1/agents", json=body))["models"]
        return model

    assert desired("old-node", KEY_V4)["tier"] == "exact"
    first = desired("new-node", v3)
    assert first["tier"] == "none" and first["artifact_id"] is None
    jobs = {j["fingerprint_key"]: j for j in api.get("/v1/compile-jobs").json()}
    # Its own engine waits for v3 hardware; a portable engine is built on the v4 worker.
    assert jobs[v3]["status"] == "waiting_for_hardware" and jobs[v3]["id"] == first["job_id"]
    assert jobs[KEY_V4]["status"] == "queued"
    assert jobs[KEY_V4]["options"]["portability"] == "portable"

    portable_options = CompileOptions(portability="portable")
    with session_scope(factory) as session:
        fallback, _ = repo.record_artifact(session, model_id=model_id, manifest=manifest(
            model_id, options=portable_options, fingerprint_key=KEY_V4,
        ).model_copy(update={"compatibility_key": portable}))
    second = desired("new-node", v3)
    assert second["tier"] == "fallback" and second["artifact_id"] == fallback.id
    assert second["job_id"] == first["job_id"]  # the exact build is still the one in flight
    assert len(api.get("/v1/compile-jobs").json()) == 2  # nothing queued twice

    with session_scope(factory) as session:
        own, _ = repo.record_artifact(session, model_id=model_id, manifest=manifest(
            model_id, options=options, fingerprint_key=v3))
    third = desired("new-node", v3)
    assert third["tier"] == "exact" and third["artifact_id"] == own.id

    summary = api.get("/v1/fleet").json()
    keys = {k["fingerprint_key"]: k for k in summary["keys"]}
    assert keys[KEY_V4]["agents"] == 1 and keys[KEY_V4]["workers"] == 1
    assert keys[v3]["agents"] == 1 and keys[v3]["workers"] == 0
    assert summary["deployments"] == [{"deployment": "svc", "keys": {KEY_V4: "exact",
                                                                     v3: "exact"}}]


def test_a_newer_fallback_the_node_cannot_run_does_not_hide_one_it_can(api, settings):
    """Two portable engines of the model: the newer one (int8, say) needs an instruction the
    node lacks. The node is served the older one, whichever was recorded last."""
    factory, model_id = v4_worker_and_model(api, settings)
    deploy(api, "svc", model_id, {})
    runs_here = record_portable(factory, model_id, CompileOptions(portability="portable"))
    record_portable(factory, model_id, CompileOptions(portability="portable", precision="int8"),
                    features=("avx512_vnni|avx_vnni|amx_int8",))  # newer, not for a v3 node
    (model,) = signed_state(api, api.post("/v1/agents", json=registration("v3-node", V3)))[
        "models"]
    assert model["tier"] == "fallback" and model["artifact_id"] == runs_here, model


def test_fleet_reports_fallback_tier_from_agents(api, settings):
    model_id = upload(api, mlp().SerializeToString()).json()["id"]
    deploy(api, "svc", model_id, {})
    register(api, "n", {})
    status = {"deployment": "svc", "state": "serving", "artifact_id": "a", "tier": "fallback"}
    api.post("/v1/agents/n/heartbeat", json={"models": [status]})
    (coverage,) = api.get("/v1/fleet").json()["deployments"]
    assert coverage == {"deployment": "svc", "keys": {KEY: "fallback"}}


def test_an_agent_token_speaks_only_for_its_own_agent(api):
    from services.api.auth import Role
    from tests.services.api.conftest import bearer

    body = registration("edge-1", KEY)
    own = {"Authorization": bearer(Role.AGENT, agent="edge-1")}
    other = {"Authorization": bearer(Role.AGENT, agent="edge-2")}
    assert api.post("/v1/agents", json=body, headers=own).status_code == 200
    refused = api.post("/v1/agents/edge-1/heartbeat", json={"models": []}, headers=other)
    assert refused.status_code == 403
    assert "kiln token create --role agent --agent edge-1" in refused.json()["message"]
    assert api.post("/v1/agents", json=body, headers=other).status_code == 403
    assert api.post("/v1/agents/edge-1/heartbeat", json={"models": []},
                    headers=own).status_code == 200


def test_a_torch_program_deploys_to_the_key_that_builds_it(api, settings, tmp_path):
    """An agent prefers onnxruntime, but a torch.export program is built for its AOTInductor
    key: the live workers say which formats each key builds."""
    from tests.models.torch_programs import tiny_mlp_archive

    aoti = "aoti-cpu-x86-64-v3-torch2.13"
    pt2 = tiny_mlp_archive(tmp_path / "tiny.pt2")
    model_id = api.post("/v1/models", files={"file": ("tiny.pt2", pt2.read_bytes())}).json()["id"]
    factory = make_session_factory(make_engine(settings.database_url))
    with session_scope(factory) as session:
        repo.heartbeat_worker(session, name="w", fingerprint_keys=[KEY, aoti], fingerprint=FP,
                              model_formats={KEY: ["onnx"], aoti: ["torch-export"]})
    body = registration("edge-1", KEY, {"site": "a"}, torch="2.13")
    assert body["fingerprint_keys"] == {"onnxruntime": KEY, "aotinductor": aoti}
    response = api.post("/v1/agents", json=body)
    assert response.status_code == 200, response.text
    created = deploy(api, "tiny", model_id, {"site": "a"})
    assert created.status_code == 201, created.text
    (job_id,) = created.json()["build_jobs"]
    assert api.get(f"/v1/compile-jobs/{job_id}").json()["fingerprint_key"] == aoti
    (desired,) = beat(api, "edge-1")["models"]
    assert desired["backend"] == "aotinductor" and desired["job_id"] == job_id


def test_a_failed_build_behind_a_deployment_is_retried_with_visible_backoff(api, settings):
    from datetime import timedelta

    from schemas.errors import ErrorBody, ErrorCode
    from services.db.tables import CompileJobRow

    model_id = upload(api, mlp(seed=11).SerializeToString()).json()["id"]
    register(api, "edge-1", {"site": "a"})
    (first,) = deploy(api, "mlp", model_id, {"site": "a"}).json()["build_jobs"]
    factory = api.app.state.session_factory

    def fail(job_id: str, *, ago_s: float = 0) -> None:
        with session_scope(factory) as session:
            repo.fail_job(session, job_id=job_id, error=ErrorBody(
                code=ErrorCode.BUILD_FAILED, message="the compiler crashed"))
            session.get(CompileJobRow, job_id).finished_at -= timedelta(seconds=ago_s)
            session.commit()

    fail(first)
    (desired,) = beat(api, "edge-1")["models"]
    job = api.get(f"/v1/compile-jobs/{first}").json()
    assert desired["job_id"] == first and desired["retry_at"] is not None
    assert job["retry_at"] is not None  # the operator sees it too
    waited = (_dt(job["retry_at"]) - _dt(job["finished_at"])).total_seconds()
    assert waited == settings.build_retry_base_s
    assert len(queued_messages(settings)) == 1  # not retried on every heartbeat

    with session_scope(factory) as session:  # the backoff has passed
        session.get(CompileJobRow, first).finished_at -= timedelta(seconds=waited + 1)
        session.commit()
    (desired,) = beat(api, "edge-1")["models"]
    second = desired["job_id"]
    assert second != first and desired["retry_at"] is None
    assert len(queued_messages(settings)) == 2

    fail(second)  # twice in a row: the wait doubles
    beat(api, "edge-1")
    job = api.get(f"/v1/compile-jobs/{second}").json()
    assert (_dt(job["retry_at"]) - _dt(job["finished_at"])).total_seconds() == 2 * waited
    assert len(queued_messages(settings)) == 2


def _dt(text: str):
    from datetime import datetime

    return datetime.fromisoformat(text)


def _two_backend_node(api, settings, tmp_path, *, ort_formats: list[str]):
    """A torch program, a live worker building its formats on both keys of a node that has
    onnxruntime and AOTInductor, and that node registered as ``edge-1``."""
    from tests.models.torch_programs import tiny_mlp_archive

    aoti = "aoti-cpu-x86-64-v3-torch2.13"
    pt2 = tiny_mlp_archive(tmp_path / "tiny.pt2")
    model_id = api.post("/v1/models", files={"file": ("tiny.pt2", pt2.read_bytes())}).json()["id"]
    factory = make_session_factory(make_engine(settings.database_url))
    with session_scope(factory) as session:
        repo.heartbeat_worker(session, name="w", fingerprint_keys=[KEY, aoti], fingerprint=FP,
                              model_formats={KEY: ort_formats, aoti: ["torch-export"]})
    response = api.post("/v1/agents", json=registration("edge-1", KEY, {"site": "a"},
                                                        torch="2.13"))
    assert response.status_code == 200, response.text
    return model_id, aoti


def _record(settings, model_id: str, key: str, backend: str, p50_ms: float) -> str:
    factory = make_session_factory(make_engine(settings.database_url))
    built = manifest(model_id, fingerprint_key=key, p50_ms=p50_ms).model_copy(
        update={"backend": backend})
    with session_scope(factory) as session:
        artifact, _ = repo.record_artifact(session, model_id=model_id, manifest=built)
    return artifact.id


def test_a_torch_program_is_built_by_both_backends_and_the_agent_gets_the_faster(
        api, settings, tmp_path):
    model_id, aoti = _two_backend_node(api, settings, tmp_path,
                                       ort_formats=["onnx", "torch-export"])
    created = deploy(api, "tiny", model_id, {"site": "a"})
    assert created.status_code == 201, created.text
    jobs = created.json()["build_jobs"]
    assert sorted(api.get(f"/v1/compile-jobs/{j}").json()["fingerprint_key"]
                  for j in jobs) == sorted([KEY, aoti])
    assert len(queued_messages(settings)) == 2
    (desired,) = beat(api, "edge-1")["models"]
    assert desired["tier"] == "none" and desired["choice"] is None
    assert len(queued_messages(settings)) == 2  # no second build on a heartbeat

    # AOTInductor lands first: the only engine.
    aoti_id = _record(settings, model_id, aoti, "aotinductor", p50_ms=0.5)
    (desired,) = beat(api, "edge-1")["models"]
    assert (desired["artifact_id"], desired["backend"], desired["fingerprint_key"]) == (
        aoti_id, "aotinductor", aoti)
    assert desired["choice"]["reason"] == "only"
    assert desired["choice"]["missing"] == {"onnxruntime": "queued"}
    # onnxruntime lands, faster: the agent moves to it, and the state says why.
    ort_id = _record(settings, model_id, KEY, "onnxruntime", p50_ms=0.2)
    state = beat(api, "edge-1")
    assert state["schema_version"] == "1.2"
    (desired,) = state["models"]
    assert (desired["artifact_id"], desired["backend"], desired["tier"]) == (
        ort_id, "onnxruntime", "exact")
    choice = desired["choice"]
    assert choice["reason"] == "fastest" and choice["tier"] == "exact"
    assert [(c["backend"], c["p50_ms"]) for c in choice["candidates"]] == [
        ("onnxruntime", 0.2), ("aotinductor", 0.5)]


def test_an_onnx_only_key_is_not_planned_for_a_program(api, settings, tmp_path):
    """The node's onnxruntime key is built by workers that take ONNX only: the program is
    planned for AOTInductor alone."""
    model_id, aoti = _two_backend_node(api, settings, tmp_path, ort_formats=["onnx"])
    (job,) = deploy(api, "tiny", model_id, {"site": "a"}).json()["build_jobs"]
    assert api.get(f"/v1/compile-jobs/{job}").json()["fingerprint_key"] == aoti
    aoti_id = _record(settings, model_id, aoti, "aotinductor", p50_ms=0.5)
    (desired,) = beat(api, "edge-1")["models"]
    assert desired["artifact_id"] == aoti_id and desired["choice"]["reason"] == "only"
    assert desired["choice"]["missing"] == {}


@pytest.mark.parametrize("landed", [False, True])
def test_planning_two_backends_costs_the_queries_of_one(api, settings, tmp_path, landed):
    """The lookups are batched over the backends: a heartbeat planning a program for two
    backends issues as many statements as one planning it for one."""
    from sqlalchemy import event

    counts = {}
    for formats in (["onnx"], ["onnx", "torch-export"]):
        model_id, aoti = _two_backend_node(api, settings, tmp_path / formats[-1],
                                           ort_formats=formats)
        assert deploy(api, "tiny", model_id, {"site": "a"}).status_code in (200, 201)
        if landed:
            _record(settings, model_id, aoti, "aotinductor", p50_ms=0.5)
            if len(formats) == 2:
                _record(settings, model_id, KEY, "onnxruntime", p50_ms=0.2)
        beat(api, "edge-1")  # every build is queued by now
        seen: list[str] = []

        def listener(*args, seen=seen) -> None:
            seen.append(args[2])

        event.listen(api.app.state.engine, "after_cursor_execute", listener)
        try:
            (desired,) = beat(api, "edge-1")["models"]
        finally:
            event.remove(api.app.state.engine, "after_cursor_execute", listener)
        # The revocation list is read again once a second, whatever the request, in a
        # transaction of its own: neither its statement nor the transactions' BEGINs count.
        counts[len(formats)] = [s.split("WHERE")[0][:150] for s in seen
                                if "revoked_tokens" not in s and not s.startswith("BEGIN")]
        assert (desired["artifact_id"] is not None) == landed
        api.delete("/v1/deployments/tiny")
    assert counts[1] == counts[2], "\n".join(counts[1]) + "\n----\n" + "\n".join(counts[2])


def test_an_fp32_deployment_never_falls_back_to_a_reduced_precision_engine(api, settings):
    """The model's portable engines: fp32, then a newer int8 one that runs on the node. An
    fp32 deployment is served the fp32 one (int8 would change its answers silently); one that
    allows int8 under the same gate takes the int8 engine, and not under a stricter gate."""
    factory, model_id = v4_worker_and_model(api, settings)
    fp32 = record_portable(factory, model_id, CompileOptions(portability="portable"))
    int8 = record_portable(factory, model_id,
                           CompileOptions(portability="portable", precision="int8"),
                           precision="int8-dynamic")
    deploy(api, "exact-numerics", model_id, {"tier": "a"})
    deploy(api, "any-int8", model_id, {"tier": "b"}, precision="int8")
    deploy(api, "strict-int8", model_id, {"tier": "c"}, precision="int8",
           accuracy={"metric": "cosine", "threshold": 0.999})
    served = {}
    for tier in "abc":
        body = registration(f"v3-{tier}", V3, {"tier": tier})
        (model,) = signed_state(api, api.post("/v1/agents", json=body))["models"]
        assert model["tier"] == "fallback", model
        served[tier] = model["artifact_id"]
    assert served == {"a": fp32, "b": int8, "c": fp32}

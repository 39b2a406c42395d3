"""A deployment's batching policy at deploy: refused (422, naming the limit) where the model's
engine cannot honour it, carried to the agents in the desired state, and its preferred size
made the ``opt`` of the batch axis of the compile's shape profile."""

from __future__ import annotations

from kiln.examples import mlp
from tests.services.api.test_api import upload
from tests.services.api.test_fleet import beat, register, settings  # noqa: F401 - fixture


def _post(api, model_id: str, batching: dict, options: dict | None = None):
    return api.post("/v1/deployments", json={
        "name": "mlp", "model_id": model_id, "selector": {"site": "a"},
        "options": options or {}, "batching": batching})


def _static_batch_mlp() -> bytes:
    model = mlp()
    for value in (*model.graph.input, *model.graph.output):
        dim = value.type.tensor_type.shape.dim[0]
        dim.ClearField("dim_param")
        dim.dim_value = 4
    return model.SerializeToString()


def test_a_static_batch_axis_is_refused_naming_it(api):
    model_id = upload(api, _static_batch_mlp()).json()["id"]
    response = _post(api, model_id, {"max_batch_size": 4})
    assert response.status_code == 422, response.text
    assert "static" in response.text and "x [4, 64]" in response.text


def test_a_maximum_above_the_shape_profile_is_refused_naming_the_limit(api):
    model_id = upload(api, mlp().SerializeToString()).json()["id"]
    profile = {"x": {"min": [1, 64], "opt": [2, 64], "max": [8, 64]}}
    response = _post(api, model_id, {"max_batch_size": 16}, {"shapes": profile})
    assert response.status_code == 422, response.text
    assert "max 8" in response.text and "max_batch_size is 16" in response.text
    assert _post(api, model_id, {"max_batch_size": 8}, {"shapes": profile}).status_code == 201


def test_a_bad_policy_is_a_422_naming_the_field(api):
    model_id = upload(api, mlp().SerializeToString()).json()["id"]
    response = _post(api, model_id, {"max_batch_size": 4, "preferred_batch_sizes": [8]})
    assert response.status_code == 422 and "preferred_batch_sizes" in response.text


def test_the_policy_reaches_the_agent_and_its_preferred_size_the_profile(api):
    model_id = upload(api, mlp().SerializeToString()).json()["id"]
    register(api, "edge-1", {"site": "a"})
    policy = {"max_batch_size": 16, "max_queue_delay_us": 200,
              "preferred_batch_sizes": [8, 4], "instances": 2}
    created = _post(api, model_id, policy)
    assert created.status_code == 201, created.text
    deployment = created.json()["deployment"]
    assert deployment["batching"] == {**policy, "preferred_batch_sizes": [4, 8]}
    assert deployment["options"]["shapes"] == {
        "x": {"min": [1, 64], "opt": [8, 64], "max": [16, 64]}}
    (desired,) = beat(api, "edge-1")["models"]
    assert desired["batching"] == deployment["batching"]
    # A change of the policy alone is a new generation the agents hear of.
    changed = _post(api, model_id, {**policy, "max_queue_delay_us": 0})
    assert changed.status_code == 200
    assert changed.json()["deployment"]["generation"] == deployment["generation"] + 1
    (desired,) = beat(api, "edge-1")["models"]
    assert desired["batching"]["max_queue_delay_us"] == 0

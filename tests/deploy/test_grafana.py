"""deploy/grafana/kiln.json: it parses as a Grafana dashboard, and every metric its panels'
PromQL names is one that a real API's and a real agent's ``/metrics`` expose after some
activity (a job queued, a worker's and an agent's heartbeats, inferences served and failed).
The API's ``/metrics`` needs a token, and refuses an agent's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kiln.examples import mlp
from runtime_agent.artifact_dir import load_artifact
from runtime_agent.server import create_app as create_agent_app
from runtime_agent.serving import ModelTable, ServedModel
from services.api.app import create_app
from services.api.auth import Role
from tests.runtime_agent.helpers import Fixtures, built
from tests.services.api.conftest import bearer, make_settings, node_fingerprint, registration

__all__ = ["built"]

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kiln.json"
KEY = "ort-cpu-x86-64-v3-ort1.20"

#: PromQL words that are not metric names.
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
             "or", "unless", "offset", "inf", "nan"}


def query_metrics(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are neither a function
    call, a label matcher or grouping, a range, a string nor a keyword."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)         # string literals
    text = re.sub(r"\{[^}]*\}", "", text)                  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)                 # ranges
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    names = {m.group(1) for m in re.finditer(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\(?)", text)
             if not m.group(2)}
    return {n for n in names if n.lower() not in _KEYWORDS and not n[0].isdigit()}


def sample_names(exposition: str) -> set[str]:
    return {sample.name for family in text_string_to_metric_families(exposition)
            for sample in family.samples}


def test_query_metrics_reads_promql() -> None:
    assert query_metrics('histogram_quantile(0.9, sum by (le) (rate(a_bucket{s="x"}[1h])))') \
        == {"a_bucket"}
    assert query_metrics("time() - b_seconds{state=\"alive\"}") == {"b_seconds"}
    assert query_metrics("sum by (m) (rate(c[5m])) / sum by (m) (rate(d[5m]))") == {"c", "d"}


def test_dashboard_parses_and_names_only_metrics_that_exist(tmp_path: Path,
                                                           built: Fixtures) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["uid"]
    panels = dashboard["panels"]
    assert panels, "the dashboard has no panels"
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"{DASHBOARD}: duplicate panel ids {ids}"

    available = api_metric_names(tmp_path) | agent_metric_names(built)
    missing = []
    for panel in panels:
        assert panel.get("targets"), f"{DASHBOARD}: panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            names = query_metrics(target["expr"])
            assert names, f"{DASHBOARD}: panel {panel['title']!r}: {target['expr']!r} names " \
                          f"no metric"
            missing += [f"panel {panel['title']!r} field targets.expr: {name}"
                        for name in sorted(names - available)]
    assert not missing, f"{DASHBOARD}: metrics no /metrics exposes: {missing}; exposed: " \
                        f"{sorted(available)}"


def api_metric_names(home: Path) -> set[str]:
    settings = make_settings(home)
    with TestClient(create_app(settings), raise_server_exceptions=False) as api:
        api.headers["Authorization"] = bearer()
        model = api.post("/v1/models", files={"file": ("m.onnx", mlp(seed=2)
                                                       .SerializeToString())}).json()
        jobs = api.post("/v1/compile-jobs", json={"model_id": model["id"],
                                                  "targets": [{"fingerprint_key": KEY}]})
        assert jobs.status_code == 202, jobs.text
        beat = api.put("/v1/builds/workers/w1", headers={"Authorization": bearer(Role.WORKER)},
                       json={"instance": "i1", "fingerprint_keys": [KEY], "heartbeat_s": 5,
                             "fingerprint": node_fingerprint(KEY).model_dump(mode="json")})
        assert beat.status_code == 200, beat.text
        agent = {"Authorization": bearer(Role.AGENT, agent="edge-1")}
        assert api.post("/v1/agents", json=registration("edge-1", KEY, {"site": "a"}),
                        headers=agent).status_code == 200
        beat = api.post("/v1/agents/edge-1/heartbeat", headers=agent, json={
            "models": [{"deployment": "d", "state": "serving"}],
            "trust": {"desired_version": 3}})
        assert beat.status_code == 200, beat.text
        api.app.state.heartbeats.flush()

        assert api.get("/metrics", headers={"Authorization": ""}).status_code == 401
        assert api.get("/metrics", headers=agent).status_code == 403
        reader = api.get("/metrics", headers={"Authorization": bearer(Role.READER)})
        assert reader.status_code == 200, reader.text
        text = reader.text
    assert f'kiln_queue_depth{{fingerprint_key="{KEY}"}} 1.0' in text
    assert re.search(r'kiln_jobs\{stage="pending",status="(queued|waiting_for_hardware)"\} '
                     r'1\.0', text), text
    assert 'kiln_agent_desired_state_version{agent="edge-1"} 3.0' in text
    assert 'kiln_workers{state="alive"} 1.0' in text
    return sample_names(text)


def agent_metric_names(built: Fixtures) -> set[str]:
    table = ModelTable()
    table.put(ServedModel("mlp", load_artifact(built.mlp_a), tier="exact"))
    agent = TestClient(create_agent_app(table, token="s3cret"))
    auth = {"Authorization": "Bearer s3cret"}
    x = np.ones((2, 64), np.float32).tolist()
    assert agent.post("/v1/models/mlp/infer", json={"inputs": {"x": x}}, headers=auth).is_success
    assert agent.post("/v1/models/mlp/infer", json={"inputs": {}}, headers=auth).status_code == 400
    assert agent.get("/metrics").status_code == 401
    return sample_names(agent.get("/metrics", headers=auth).text)


@pytest.mark.parametrize("expr", ["kiln_nonexistent_total", "rate(kiln_jobs_typo[5m])"])
def test_a_query_naming_an_unknown_metric_is_caught(expr: str) -> None:
    assert query_metrics(expr) - {"kiln_jobs", "kiln_agents"}

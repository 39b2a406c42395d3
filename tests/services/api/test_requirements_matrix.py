"""The variant matrix through the control plane: six declared variants of one SPR-like host x
an fp32, an int8 and a bf16 engine built on that host. Each agent registers through the real
API (SQLite, real planner, signed desired state); the test checks the tier it is served at,
whether the engine's requirements refuse it, and whether its own tuning is queued.

The engines' manifests are written by the test and recorded straight in the database: this
machine has neither VNNI nor AMX/BF16, so an int8 engine without reduce_range and a bf16
engine cannot be built here for real. Their requirements and tuning contexts are the ones the
onnxruntime executor derives (the bf16 one is written as OpenVINO's bf16 needs it); no engine
binary is executed. ``tests/schemas/test_requirements.py`` checks the rules one by one."""

from __future__ import annotations

import pytest

from kiln.examples import mlp
from runtime_agent.executors import (
    OnnxRuntimeExecutor,
    node_compatibility_keys,
    node_fingerprint_keys,
)
from runtime_agent.fingerprint import declare_variant
from schemas.fingerprint import (
    CpuInfo,
    EngineRequirements,
    HardwareFingerprint,
    TuningContext,
    tuning_context_key,
)
from services.db import make_engine, make_session_factory, repo, session_scope
from tests.services.api.test_api import upload
from tests.services.api.test_fleet import deploy, settings, signed_state  # noqa: F401
from tests.services.db.helpers import manifest

V4 = ["ssse3", "sse4_1", "sse4_2", "popcnt", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2",
      "avx512f", "avx512cd", "avx512dq", "avx512bw", "avx512vl"]
HOST = HardwareFingerprint(
    cpu=CpuInfo(arch="x86_64", vendor="GenuineIntel", model="declared SPR-like", cores=2,
                features=[*V4, "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile",
                          "amx_bf16", "amx_int8"]),
    runtimes={"onnxruntime": "1.32.0"}, source="declared")
KEY = OnnxRuntimeExecutor.fingerprint_key(HOST)
VARIANTS = {"host": HOST, **{v: declare_variant(HOST, v) for v in (
    "no-vnni", "no-amx-bf16", "cores=64", "older", "aarch64")}}

_INT8 = {"optimization_level": 3, "quantize": "static-qdq", "reduce_range": False}
ENGINES = {
    "fp32": (OnnxRuntimeExecutor.requirements(HOST, {"optimization_level": 3}, "fp32"),
             OnnxRuntimeExecutor.tuning_context(HOST, {}, "fp32", threads_tuned=True)),
    "int8": (OnnxRuntimeExecutor.requirements(HOST, _INT8, "int8-static-qdq"),
             OnnxRuntimeExecutor.tuning_context(HOST, _INT8, "int8", threads_tuned=True)),
    "bf16": (EngineRequirements(arch="x86_64", isa_level="x86-64-v4",
                                features=["amx_bf16|avx512_bf16"],
                                runtimes={"onnxruntime": "1.32"}),
             TuningContext(cpu_model=HOST.cpu.model, cores=2, core_class="c1-4",
                           depends_on=["amx_bf16", "avx512_bf16"],
                           features=["amx_bf16", "avx512_bf16"])),
}

# variant -> engine -> (tier served, "none" for no engine; refused by its requirements;
# own tuning queued)
EXPECTED = {
    "host":        {"fp32": ("exact", False, False), "int8": ("exact", False, False),
                    "bf16": ("exact", False, False)},
    "no-vnni":     {"fp32": ("exact", False, False), "int8": ("none", True, True),
                    "bf16": ("exact", False, False)},
    "no-amx-bf16": {"fp32": ("exact", False, False), "int8": ("compatible", False, True),
                    "bf16": ("none", True, True)},
    "cores=64":    {"fp32": ("compatible", False, True), "int8": ("exact", False, False),
                    "bf16": ("exact", False, False)},
    "older":       {"fp32": ("none", False, False), "int8": ("none", False, False),
                    "bf16": ("none", False, False)},
    "aarch64":     {"fp32": ("none", False, False), "int8": ("none", False, False),
                    "bf16": ("none", False, False)},
}


def _register(api, name: str, fingerprint: HardwareFingerprint) -> dict:
    return signed_state(api, api.post("/v1/agents", json={
        "name": name, "labels": {"matrix": "yes"},
        "fingerprint": fingerprint.model_dump(mode="json"),
        "fingerprint_keys": node_fingerprint_keys(fingerprint),
        "compatibility_keys": node_compatibility_keys(fingerprint)}))


@pytest.mark.parametrize("engine", list(ENGINES))
def test_variant_matrix(api, settings, engine):  # noqa: F811
    requirements, context = ENGINES[engine]
    model_id = upload(api, mlp().SerializeToString()).json()["id"]
    recorded = manifest(model_id, fingerprint_key=KEY).model_copy(update={
        "build_fingerprint": HOST, "requirements": requirements, "tuning_context": context})
    factory = make_session_factory(make_engine(settings.database_url))
    with session_scope(factory) as session:
        artifact, _ = repo.record_artifact(session, model_id=model_id, manifest=recorded)
    assert deploy(api, "matrix", model_id, {"matrix": "yes"}).status_code == 201
    before: set[str] = set()
    for variant, fingerprint in VARIANTS.items():
        tier, refused, retune = EXPECTED[variant][engine]
        [model] = _register(api, variant.replace("=", "-"), fingerprint)["models"]
        assert model.get("tier") == tier, (variant, model)
        assert (model.get("artifact_id") == artifact.id) == (tier != "none"), (variant, model)
        choice = (model.get("choice") or {}).get("message", "")
        assert ("requirements unmet" in choice) == refused, (variant, choice)
        jobs = {j["fingerprint_key"] for j in api.get("/v1/compile-jobs").json()}
        new, before = jobs - before, jobs
        # Its own tuning is queued under its absolute context key, whatever engine it was
        # compared with, and nothing else is.
        assert ({j for j in new if "-t-" in j} == {own_key(fingerprint)}) == retune, (
            variant, new)


def own_key(fingerprint: HardwareFingerprint) -> str:
    """The node's own tuning-context key for onnxruntime."""
    return tuning_context_key(OnnxRuntimeExecutor.fingerprint_key(fingerprint), fingerprint,
                              OnnxRuntimeExecutor.tuning_features)


def test_context_key_is_absolute():
    """The key names the node's core class and the tuning features it has, not its
    differences from one engine: two engines' comparisons of one node queue one key."""
    wide = VARIANTS["cores=64"]
    assert own_key(wide) == f"{KEY}-t-c17-64-amxint8-avx512vnni-avxvnni"
    assert own_key(VARIANTS["no-vnni"]) == f"{KEY}-t-c1-4"  # none of the int8 dot products
    assert own_key(declare_variant(HOST, "cores=128")).startswith(f"{KEY}-t-c65plus-")
    assert own_key(HOST) != own_key(wide)


def test_own_tuning_is_served_first(api, settings):  # noqa: F811
    """A node whose own tuning landed (an artifact under its context key) is served that at
    ``exact``, with its context key in the signed state, and queues nothing more; the host
    keeps the plain key's engine."""
    requirements, context = ENGINES["fp32"]
    wide = VARIANTS["cores=64"]
    model_id = upload(api, mlp().SerializeToString()).json()["id"]
    factory = make_session_factory(make_engine(settings.database_url))
    with session_scope(factory) as session:
        plain, _ = repo.record_artifact(session, model_id=model_id, manifest=manifest(
            model_id, fingerprint_key=KEY).model_copy(update={
                "build_fingerprint": HOST, "requirements": requirements,
                "tuning_context": context}))
        mine, _ = repo.record_artifact(session, model_id=model_id, manifest=manifest(
            model_id, fingerprint_key=own_key(wide)).model_copy(update={
                "build_fingerprint": wide,
                "requirements": OnnxRuntimeExecutor.requirements(
                    wide, {"optimization_level": 3}, "fp32"),
                "tuning_context": OnnxRuntimeExecutor.tuning_context(
                    wide, {}, "fp32", threads_tuned=True)}))
    assert deploy(api, "matrix", model_id, {"matrix": "yes"}).status_code == 201
    [model] = _register(api, "wide", wide)["models"]
    assert (model["tier"], model["artifact_id"], model["fingerprint_key"]) == (
        "exact", mine.id, own_key(wide)), model
    [model] = _register(api, "host", HOST)["models"]
    assert (model["tier"], model["artifact_id"], model["fingerprint_key"]) == (
        "exact", plain.id, KEY), model
    assert [j for j in api.get("/v1/compile-jobs").json() if "-t-" in j["fingerprint_key"]] \
        == []

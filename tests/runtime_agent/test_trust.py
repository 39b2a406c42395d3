"""``runtime_agent.trust`` in-process: schema versions of desired state, and the trust record."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from artifact_store.signing import DESIRED_STATE_PAYLOAD_TYPE
from runtime_agent.trust import AgentTrust
from schemas.errors import ErrorCode, KilnError, MetadataRefused, SchemaUnsupported
from tests.runtime_agent.helpers import Fixtures, desired_model


def state(version: int, **extra) -> dict:
    now = datetime.now(UTC)
    return {"schema_version": "1.0", "agent": "node-1", "heartbeat_s": 1.0, "version": version,
            "models": [desired_model("mlp", "a1").model_dump(mode="json")],
            "issued_at": now.isoformat(), "expires": (now + timedelta(minutes=5)).isoformat(),
            **extra}


def envelope(built: Fixtures, document: dict) -> bytes:
    return built.keys.signer.sign_envelope(json.dumps(document).encode(),
                                           DESIRED_STATE_PAYLOAD_TYPE)


def make(built: Fixtures, tmp_path: Path) -> AgentTrust:
    return AgentTrust(tmp_path / "trust", root_keys=[], trusted_keys=[built.keys.public],
                      agent="node-1")


def test_a_newer_minor_desired_state_with_unknown_fields_is_accepted(
        built: Fixtures, tmp_path: Path) -> None:
    trust = make(built, tmp_path)
    document = state(5, schema_version="1.4", rollout_wave=3)
    document["models"][0]["canary_percent"] = 10
    accepted = trust.verify(envelope(built, document), None)
    assert accepted.state.version == 5 and accepted.state.models[0].artifact_id == "a1"
    with pytest.raises(SchemaUnsupported, match="this Kiln reads major version 1"):
        trust.verify(envelope(built, state(6, schema_version="2.0")), None)
    with pytest.raises(KilnError, match="not a DesiredState") as info:  # own minor: strict
        trust.verify(envelope(built, state(7, rollout_wave=3)), None)
    assert info.value.code is ErrorCode.INTEGRITY_ERROR


def test_desired_state_1_1_carries_the_engine_choice(built: Fixtures, tmp_path: Path) -> None:
    """1.1 adds ``choice`` to each model; a 1.0 document (an older control plane) still
    reads."""
    from schemas.agents import DESIRED_STATE_SCHEMA_VERSION

    assert DESIRED_STATE_SCHEMA_VERSION == "1.2"
    trust = make(built, tmp_path)
    document = state(5, schema_version="1.1")
    document["models"][0]["choice"] = {
        "reason": "fastest", "tier": "exact", "message": "the lowest recorded p50",
        "candidates": [{"artifact_id": "a1", "backend": "onnxruntime", "tier": "exact",
                        "p50_ms": 0.2}], "missing": {}}
    accepted = trust.verify(envelope(built, document), None)
    assert accepted.state.models[0].choice.reason == "fastest"
    older = trust.verify(envelope(built, state(6)), None)  # 1.0: no choice
    assert older.state.models[0].choice is None
    # An agent of 1.0 reads a 1.1 state by dropping ``choice``, as any newer minor's field
    # (test_a_newer_minor_desired_state_with_unknown_fields_is_accepted).


def test_the_trust_record_keeps_the_highest_version(built: Fixtures, tmp_path: Path) -> None:
    trust = make(built, tmp_path)
    trust.verify(envelope(built, state(10)), None)
    same = envelope(built, state(10, heartbeat_s=2.0))  # the same version, other bytes
    with pytest.raises(MetadataRefused, match="differs from the one this agent accepted"):
        trust.verify(same, None)
    again = make(built, tmp_path)  # a restart
    with pytest.raises(MetadataRefused, match="older than version 10"):
        again.verify(envelope(built, state(9)), None)
    again.verify(envelope(built, state(11)), None)

    (tmp_path / "trust" / "state.json").write_text("{broken")
    with pytest.raises(KilnError, match="protects against rollback") as info:
        make(built, tmp_path)
    assert info.value.code is ErrorCode.CONFIG_ERROR

"""choose_engine: the fastest verified engine of the best tier; ties and missing benchmarks go
to the agent's backend preference; the answer says why."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from schemas.manifest import ArtifactSummary
from services.api.engine_choice import Usable, choose_engine, recorded_p50

PREFERENCE = ["onnxruntime", "aotinductor"]


def usable(backend: str, p50: float | None, tier: str = "exact", *, id_: str = "") -> Usable:
    return Usable(ArtifactSummary(
        id=id_ or f"{backend}-{tier}", model_id="m" * 64, backend=backend,
        fingerprint_key=f"{backend}-key", options_digest="o" * 64, toolchain="t",
        size_bytes=1, max_abs_error=0.0, p50_ms=0.0 if p50 is None else p50,
        created_at=datetime(2026, 1, 1, tzinfo=UTC)), tier)


def test_the_lowest_recorded_p50_wins_whatever_the_preference() -> None:
    chosen, choice = choose_engine(
        [usable("onnxruntime", 0.9), usable("aotinductor", 0.4)], PREFERENCE)
    assert chosen.artifact.backend == "aotinductor"
    assert choice.reason == "fastest" and choice.tier == "exact"
    assert [c.backend for c in choice.candidates] == ["aotinductor", "onnxruntime"]
    assert [c.p50_ms for c in choice.candidates] == [0.4, 0.9]
    assert "aotinductor 0.400 ms" in choice.message and "onnxruntime 0.900 ms" in choice.message
    # The order the candidates come in does not matter.
    again, _ = choose_engine([usable("aotinductor", 0.4), usable("onnxruntime", 0.9)],
                             PREFERENCE)
    assert again.artifact.backend == "aotinductor"
    faster_ort, _ = choose_engine([usable("onnxruntime", 0.2), usable("aotinductor", 0.4)],
                                  PREFERENCE)
    assert faster_ort.artifact.backend == "onnxruntime"


def test_an_exact_engine_beats_a_faster_compatible_one() -> None:
    chosen, choice = choose_engine(
        [usable("onnxruntime", 0.1, "compatible"), usable("aotinductor", 5.0, "exact"),
         usable("onnxruntime", 0.05, "fallback")], PREFERENCE)
    assert chosen.artifact.backend == "aotinductor" and chosen.tier == "exact"
    assert choice.reason == "only" and choice.tier == "exact"
    assert [c.tier for c in choice.candidates] == ["exact", "compatible", "fallback"]
    assert "compatible/fallback engines are not weighed against exact ones" in choice.message


def test_compatible_before_fallback_and_fastest_within_the_tier() -> None:
    chosen, choice = choose_engine(
        [usable("onnxruntime", 0.9, "compatible"), usable("aotinductor", 0.3, "compatible"),
         usable("onnxruntime", 0.01, "fallback", id_="portable")], PREFERENCE)
    assert chosen.artifact.id == "aotinductor-compatible"
    assert (choice.reason, choice.tier) == ("fastest", "compatible")


def test_a_tie_goes_to_the_agents_preference() -> None:
    for preference, winner in ((PREFERENCE, "onnxruntime"),
                               (list(reversed(PREFERENCE)), "aotinductor")):
        chosen, choice = choose_engine(
            [usable("aotinductor", 0.5), usable("onnxruntime", 0.5)], preference)
        assert chosen.artifact.backend == winner
        assert choice.reason == "tie" and "share the lowest recorded p50" in choice.message


def test_a_tie_among_the_fastest_only() -> None:
    chosen, choice = choose_engine(
        [usable("tensorrt", 0.1), usable("aotinductor", 0.1), usable("onnxruntime", 0.9)],
        ["onnxruntime", "aotinductor", "tensorrt"])
    assert chosen.artifact.backend == "aotinductor" and choice.reason == "tie"


def test_a_missing_p50_leaves_the_choice_to_preference() -> None:
    assert recorded_p50(usable("aotinductor", None).artifact) is None
    chosen, choice = choose_engine(
        [usable("aotinductor", 0.1), usable("onnxruntime", None)], PREFERENCE)
    assert chosen.artifact.backend == "onnxruntime"
    assert choice.reason == "preference" and "no recorded p50 for onnxruntime" in choice.message
    assert [c.p50_ms for c in choice.candidates] == [None, 0.1]
    # Preferred first: the preference decides even when the preferred one is the timed one.
    chosen, _ = choose_engine([usable("aotinductor", None), usable("onnxruntime", 3.0)],
                              PREFERENCE)
    assert chosen.artifact.backend == "onnxruntime"


def test_a_backend_the_preference_does_not_list_comes_last() -> None:
    chosen, _ = choose_engine([usable("zeta", None), usable("aotinductor", None)], PREFERENCE)
    assert chosen.artifact.backend == "aotinductor"


def test_one_or_no_candidate() -> None:
    assert choose_engine([], PREFERENCE) is None
    chosen, choice = choose_engine([usable("aotinductor", 0.4)], PREFERENCE,
                                   missing={"onnxruntime": "failed: unsupported_operator"})
    assert chosen.artifact.backend == "aotinductor" and choice.reason == "only"
    assert choice.missing == {"onnxruntime": "failed: unsupported_operator"}
    assert "onnxruntime (failed: unsupported_operator)" in choice.message


def test_an_unknown_tier_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown tier 'none'"):
        choose_engine([usable("aotinductor", 0.4, "none")], PREFERENCE)

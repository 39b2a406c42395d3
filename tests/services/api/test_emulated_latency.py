"""Emulated timings are never compared with native ones: an emulated agent's latency result
carries no figure (a result that does is refused), and the latency gate passes it uncompared,
while a native one over the ratio still fails."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from schemas.rollouts import (
    GateResult,
    GoldenGate,
    LatencyGate,
    RolloutPolicy,
    RolloutReport,
    emulated_latency,
)
from services.api.rollouts import judge

POLICY = RolloutPolicy(stages=["100%"], gates=[GoldenGate(), LatencyGate(max_ratio=1.5)])
GOLDEN = GateResult(name="golden", passed=True)


def test_an_emulated_latency_result_carrying_a_figure_is_refused() -> None:
    with pytest.raises(ValidationError, match="under emulation carries no p50"):
        GateResult(name="latency", passed=True, emulated=True, p50_ms=900.0,
                   benchmark_p50_ms=1.0)


def test_the_latency_gate_does_not_compare_an_emulated_result() -> None:
    report = RolloutReport(agent="arm", gates=[GOLDEN, emulated_latency()])
    assert judge(POLICY, report) == (True, "")
    native = GateResult(name="latency", passed=True, p50_ms=9.0, benchmark_p50_ms=1.0)
    passed, why = judge(POLICY, RolloutReport(agent="x86", gates=[GOLDEN, native]))
    assert passed is False and "9x the benchmark" in why.replace(".00x", "x")

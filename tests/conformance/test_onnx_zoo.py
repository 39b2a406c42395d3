"""Conformance: every model of ONNX's own backend test data that onnxruntime runs compiles
with Kiln, and the engine reproduces the shipped outputs (see ``zoo.py`` for the cases and
the rules; ``bench/conformance.py`` prints the full table)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from runtime_agent.fingerprint import detect_fingerprint
from tests.conformance import zoo

pytestmark = pytest.mark.conformance

SUITES = {
    "light": zoo.light_cases,
    "pytorch-converted": lambda: zoo.directory_cases("pytorch-converted"),
    "pytorch-operator": lambda: zoo.directory_cases("pytorch-operator"),
    "node": zoo.node_cases,
}
#: At least this many models per suite must pass (a guard against a suite silently emptying).
MIN_PASSED = {"light": 9, "pytorch-converted": 82, "pytorch-operator": 35, "node": 380}
#: The light zoo again, built by OpenVINO alone (fp32, verified by the same rules). Light
#: models only: a compile of each zoo model per backend would take the suite's time twice.
#: (SqueezeNet is skipped where OpenVINO's own f32 outputs differ from the test data.)
OPENVINO_MIN_PASSED = 8


@pytest.mark.parametrize("suite", list(SUITES))
def test_onnx_zoo(suite: str, tmp_path: Path) -> None:
    import onnxruntime

    onnxruntime.set_default_logger_severity(4)
    fingerprint = detect_fingerprint()
    outcomes = [zoo.run_case(case, fingerprint, tmp_path) for case in SUITES[suite]()]
    _judge(suite, outcomes, MIN_PASSED[suite])


def _judge(label: str, outcomes: list, minimum: int) -> None:
    """Print the suite's tally and every model that did not pass; fail on any failure, or
    when fewer than ``minimum`` passed."""
    counts = Counter(o.status for o in outcomes)
    lines = [f"{label}: {len(outcomes)} models, " + ", ".join(
        f"{counts[s]} {s}" for s in ("passed", "failed", "skipped", "unsupported"))]
    lines += [f"  {o.status:11} {o.case}: {o.reason}" for o in outcomes
              if o.status != "passed"]
    print("\n".join(lines))
    failed = [f"{o.case}: {o.reason}" for o in outcomes if o.status == "failed"]
    assert not failed, "\n".join(failed)
    assert counts["passed"] >= minimum, lines[0]


def test_onnx_light_zoo_on_openvino(tmp_path: Path) -> None:
    """OpenVINO's engines of the light zoo (built with ``INFERENCE_PRECISION_HINT: f32`` and
    imported with it again) reproduce the shipped outputs at the light zoo's tolerance, or are
    refused where plain OpenVINO's own f32 outputs do not (then skipped, with that reason)."""
    pytest.importorskip("openvino")
    import onnxruntime

    onnxruntime.set_default_logger_severity(4)
    fingerprint = detect_fingerprint()
    outcomes = [zoo.run_case(case, fingerprint, tmp_path, backend="openvino")
                for case in zoo.light_cases()]
    _judge("light on openvino", outcomes, OPENVINO_MIN_PASSED)

"""A worker builds its own tuning context's key beside each plain key: it advertises both,
a job queued under either is its own, and one under the context key publishes under it."""

from __future__ import annotations

import pytest

from compiler_worker import backends
from compiler_worker.backends import backend_for
from compiler_worker.pipeline import plan_build
from compiler_worker.worker import fingerprint_keys
from runtime_agent.executors import OnnxRuntimeExecutor
from runtime_agent.fingerprint import declare_variant
from schemas.errors import BackendUnavailable
from schemas.fingerprint import CpuInfo, HardwareFingerprint, tuning_context_key
from schemas.options import CompileOptions

V4 = ["ssse3", "sse4_1", "sse4_2", "popcnt", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2",
      "avx512f", "avx512cd", "avx512dq", "avx512bw", "avx512vl"]
HOST = HardwareFingerprint(
    cpu=CpuInfo(arch="x86_64", vendor="GenuineIntel", model="declared", cores=2,
                features=[*V4, "avx512_vnni"]),
    runtimes={"onnxruntime": "1.32.0", "onnx": "1.17.0"}, source="declared")
KEY = OnnxRuntimeExecutor.fingerprint_key(HOST)
WIDE = declare_variant(HOST, "cores=64")
MODEL = "a" * 64


def test_the_context_key_is_the_fingerprints_alone() -> None:
    ort = backends.get("onnxruntime")
    assert ort.context_key(HOST) == f"{KEY}-t-c1-4-avx512vnni" == tuning_context_key(
        KEY, HOST, OnnxRuntimeExecutor.tuning_features)
    assert ort.context_key(WIDE) == f"{KEY}-t-c17-64-avx512vnni"


def test_a_worker_advertises_each_key_then_its_context_key() -> None:
    keys = fingerprint_keys(HOST)
    pairs = dict(zip(keys[::2], keys[1::2], strict=True))
    assert pairs[KEY] == f"{KEY}-t-c1-4-avx512vnni"
    assert all(context.startswith(f"{key}-t-") for key, context in pairs.items())


def test_a_job_under_the_context_key_is_built_and_published_under_it() -> None:
    options = CompileOptions(backends=["onnxruntime"])
    own = f"{KEY}-t-c17-64-avx512vnni"
    assert backend_for(WIDE, options, own).name == "onnxruntime"
    plan, plain = plan_build(MODEL, options, WIDE, key=own), plan_build(MODEL, options, WIDE,
                                                                        key=KEY)
    assert (plan.fingerprint_key, plain.fingerprint_key) == (own, KEY)
    assert plan.artifact_id != plain.artifact_id
    # Another context's key is not this worker's: the job was routed to the wrong queue.
    with pytest.raises(BackendUnavailable, match="t-c1-4-avx512vnni"):
        backend_for(WIDE, options, f"{KEY}-t-c1-4-avx512vnni")

"""The TensorRT executor without TensorRT: registration, import hygiene, clear refusals.

Loading and running a plan needs TensorRT and a GPU; no test here fakes either. The key and
compatibility rules are tested in ``test_fingerprints_table`` and
``tests/compiler_worker/test_compatibility``.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from runtime_agent import executors
from runtime_agent.executors import TensorRTExecutor, load_executor
from runtime_agent.executors.tensorrt.executor import device_memory
from schemas.errors import BackendUnavailable
from tests.runtime_agent.test_executors import make_artifact

NO_TENSORRT = importlib.util.find_spec("tensorrt") is None

PROGRAM = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"tensorrt", "torch", "cuda", "pynvml"}:
            raise ImportError(f"{name} is blocked in this test")
sys.meta_path.insert(0, Block())
from runtime_agent.executors import node_compatibility_keys, node_fingerprint_keys, registered
from runtime_agent.fingerprint import detect_fingerprint
fp = detect_fingerprint()
assert "tensorrt" in registered() and "tensorrt" not in node_fingerprint_keys(fp)
assert not {"tensorrt", "torch", "cuda", "pynvml"} & set(sys.modules)
print("ok")
"""


def test_registered_and_importable_without_tensorrt_torch_cuda_or_nvml() -> None:
    assert executors.get("tensorrt") is TensorRTExecutor
    result = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True,
                            timeout=60, cwd=Path(__file__).parents[2])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.skipif(not NO_TENSORRT, reason="TensorRT is installed here")
def test_loading_a_plan_without_tensorrt_is_backend_unavailable(tmp_path: Path) -> None:
    manifest = make_artifact(tmp_path, backend="tensorrt")
    with pytest.raises(BackendUnavailable, match="needs TensorRT, which is not installed"):
        load_executor(tmp_path, manifest)


def test_device_memory_without_torch_or_cuda_python_is_backend_unavailable(monkeypatch) -> None:
    for name in ("torch", "cuda", "cuda.bindings", "cuda.cudart"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(BackendUnavailable, match=r"install torch .* or cuda-python"):
        device_memory()

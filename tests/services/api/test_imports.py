"""The API process must import and serve with no onnxruntime, TensorRT, torch, OpenVINO or
NNCF installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BLOCKER = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"onnxruntime", "tensorrt", "torch", "openvino", "nncf"}:
            raise ImportError(f"{name} is blocked in this test")
sys.meta_path.insert(0, Block())
"""

PROGRAM = BLOCKER + """
import sys
from fastapi.testclient import TestClient
from services.api.app import create_app
from services.config import KilnSettings
app = create_app(KilnSettings(home=sys.argv[1], env="dev"))
with TestClient(app) as client:
    assert client.get("/healthz").status_code == 200
assert not {"onnxruntime", "tensorrt", "torch", "openvino", "nncf"} & set(sys.modules)
print("ok")
"""


def test_api_runs_without_heavy_toolchains(tmp_path: Path):
    result = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[3],
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")

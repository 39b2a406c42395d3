"""``kiln.runtime``: load a compiled artifact directory and run it, checked before loading."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from kiln import runtime
from schemas.errors import IntegrityError, InvalidRequest, SignatureInvalid
from tests.runtime_agent.helpers import Fixtures

X = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)


def test_load_and_run_match_onnxruntime(built: Fixtures) -> None:
    import onnxruntime as ort

    model = runtime.load(built.mlp_a, trusted_keys=[built.keys.public])
    assert [s.name for s in model.inputs] == ["x"] and [s.name for s in model.outputs] == ["y"]
    assert model.manifest.backend == "onnxruntime" and model.artifact_dir == built.mlp_a
    session = ort.InferenceSession(str(built.mlp_a / "engine.onnx"),
                                   providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(model.run({"x": X})["y"], session.run(None, {"x": X})[0])
    with pytest.raises(InvalidRequest, match=r"expected dtype float32"):
        model.run({"x": X.astype(np.float64)})


def test_a_tampered_blob_is_never_loaded(built: Fixtures, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(built.mlp_a, tmp_path / "artifact"))
    with (copy / "engine.onnx").open("r+b") as f:
        f.seek(-8, 2)
        f.write(b"\xff" * 8)
    with pytest.raises(IntegrityError, match=r"blob 'engine'.*sha256"):
        runtime.load(copy)


def test_the_signature_is_checked_when_keys_are_given(built: Fixtures) -> None:
    runtime.load(built.mlp_a)  # no keys: blobs only
    with pytest.raises(SignatureInvalid, match="not trusted"):
        runtime.load(built.mlp_a, trusted_keys=[built.untrusted.public])


def test_a_folder_without_manifest_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="is not an artifact directory"):
        runtime.load(tmp_path)

"""A torch.export program through the real API and worker: submit a .pt2, get a verified,
signed AOTInductor artifact, load and run it with ``kiln.runtime``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kiln.runtime import load
from runtime_agent.executors import MANIFEST_FILENAME, blob_filename
from schemas.jobs import JobStatus
from schemas.options import CompileOptions
from tests.models.torch_programs import tiny_mlp, tiny_mlp_archive

pytestmark = [pytest.mark.integration, pytest.mark.aotinductor]


def test_submit_a_program_and_run_its_engine(stack, tmp_path: Path) -> None:
    import torch

    from tests.integration.conftest import wait_for_worker

    client = stack.client()
    wait_for_worker(client)
    pt2 = tiny_mlp_archive(tmp_path / "tiny.pt2")
    model = client.upload_model(pt2, name="tiny")
    assert model.format == "torch-export"
    # Both backends of the worker take the program: AOTInductor, and onnxruntime through
    # the ONNX exporter.
    keys = client.live_fingerprint_keys(model.format)
    assert any(k.startswith("ort-cpu-") for k in keys), keys
    keys = [k for k in keys if k.startswith("aoti-cpu-")]
    assert len(keys) == 1, keys

    (job,) = client.create_jobs(model.id, keys, CompileOptions(tune="off"))
    done = client.wait_job(job.id, timeout_s=900)
    assert done.status is JobStatus.SUCCEEDED, done.error
    manifest = client.get_manifest(done.artifact_id)
    assert manifest.backend == "aotinductor" and manifest.fingerprint_key == keys[0]
    assert manifest.verification.passed
    assert "eager ExportedProgram.module()" in manifest.verification.reference
    assert manifest.runtime_config["isa_checked_libraries"] >= 1

    directory = tmp_path / "artifact"
    directory.mkdir()
    for ref in manifest.blobs:
        client.download_blob(done.artifact_id, ref, directory / blob_filename(ref))
    (directory / MANIFEST_FILENAME).write_bytes(client.get_signed_manifest(done.artifact_id))
    loaded = load(directory, trusted_keys=[stack.home / "signing.key.pub"])
    x = np.random.default_rng(5).standard_normal((4, 16), dtype=np.float32)
    got = loaded.run({"x": x})
    with torch.no_grad():
        want = tiny_mlp()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got[manifest.outputs[0].name], want, rtol=1e-5, atol=1e-5)

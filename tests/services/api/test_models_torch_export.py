"""POST /v1/models with torch.export archives (.pt2): detected, recorded, checked for structure
only; every malformed archive is a 4xx that stores nothing."""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from schemas.errors import InvalidModel
from schemas.torch_export import check_pickle_ops, inspect_export_archive
from tests.models.torch_programs import (
    evil_sample_inputs,
    pickled_weight,
    rewrite,
    root_of,
    save_program,
    tiny_mlp_archive,
)
from tests.services.api.test_imports import BLOCKER


@pytest.fixture(scope="module")
def pt2(tmp_path_factory) -> Path:
    return tiny_mlp_archive(tmp_path_factory.mktemp("pt2") / "tiny.pt2")


def _upload(api: TestClient, path: Path, name: str = "tiny.pt2"):
    return api.post("/v1/models", files={"file": (name, path.read_bytes())})


def test_a_pt2_is_detected_and_recorded(api: TestClient, pt2: Path) -> None:
    response = _upload(api, pt2)
    assert response.status_code == 201, response.text
    info = response.json()
    assert info["format"] == "torch-export"
    assert info["id"] == hashlib.sha256(pt2.read_bytes()).hexdigest()
    assert info["name"] == "tiny"
    assert info["inputs"] == [{"name": "x", "dtype": "float32", "shape": [4, 16]}]
    assert [o["dtype"] for o in info["outputs"]] == ["float32"]
    assert info["outputs"][0]["shape"] == [4, 8]
    assert info["opset"] >= 1 and info["ir_version"] >= 1
    assert _upload(api, pt2).status_code == 200  # same bytes, same model
    assert api.get(f"/v1/models/{info['id']}").json()["format"] == "torch-export"


def test_dynamic_dims_are_named(tmp_path: Path) -> None:
    import torch

    batch = torch.export.Dim("batch", min=1, max=32)
    path = save_program(torch.nn.Linear(3, 2), (torch.randn(4, 3),), tmp_path / "d.pt2",
                        dynamic_shapes=({0: batch},))
    info = inspect_export_archive(path)
    symbol = info.inputs[0].shape[0]
    assert isinstance(symbol, str) and info.inputs[0].shape[1:] == [3]
    assert info.dims[symbol] == (1, 32)
    assert info.outputs[0].shape == [symbol, 2]


def _zip(path: Path, members: dict[str, bytes], compression: int = zipfile.ZIP_STORED) -> Path:
    with zipfile.ZipFile(path, "w", compression=compression) as out:
        for name, data in members.items():
            out.writestr(name, data)
    return path


def _bad_archives(pt2: Path, tmp: Path) -> dict[str, tuple[Path, str]]:
    data = pt2.read_bytes()
    cases: dict[str, tuple[Path, str]] = {}
    (tmp / "truncated.pt2").write_bytes(data[: len(data) // 2])
    cases["truncated"] = (tmp / "truncated.pt2", "truncated")
    cases["not an export"] = (_zip(tmp / "notes.pt2", {"notes/readme.txt": b"hello"}),
                              "lacks")
    cases["zip bomb"] = (rewrite(pt2, tmp / "bomb.pt2", lambda m: {
        **m, f"{root_of(m)}/extra/pad.txt": b"\0" * (3 << 20)},
        compression=zipfile.ZIP_DEFLATED), "zip bomb")
    cases["unexpected member"] = (rewrite(pt2, tmp / "extra.pt2", lambda m: {
        **m, f"{root_of(m)}/data/weights/payload.pkl": b"\x80\x02N."}), "unexpected members")
    cases["pickled weight"] = (rewrite(pt2, tmp / "pickled.pt2", pickled_weight),
                               "stored pickled")
    cases["pickled extra"] = (rewrite(pt2, tmp / "pextra.pt2", lambda m: {
        **m, f"{root_of(m)}/extra/x.pt": b"\x80\x04N."}), "looks pickled")
    cases["evil sample inputs"] = (rewrite(pt2, tmp / "evil.pt2", lambda m: evil_sample_inputs(
        m, tmp / "pwned")), "may only rebuild plain tensors")
    cases["two roots"] = (rewrite(pt2, tmp / "roots.pt2", lambda m: {
        **m, "other/archive_format": b"pt2"}), "one root")
    cases["short payload"] = (rewrite(pt2, tmp / "short.pt2", lambda m: {
        **m, f"{root_of(m)}/data/weights/weight_0": b"\0" * 8}), "needs")

    def flip(m: dict[str, bytes]) -> dict[str, bytes]:
        return {**m, f"{root_of(m)}/archive_format": b"zip"}
    cases["wrong format"] = (rewrite(pt2, tmp / "fmt.pt2", flip), "archive_format")
    # A body altered after the central directory was written: the CRC check catches it.
    damaged = bytearray(data)
    with zipfile.ZipFile(pt2) as archive:
        info = archive.getinfo(f"{root_of({n: b'' for n in archive.namelist()})}/data/weights/"
                               f"weight_0")
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26:
                                                    info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len
    damaged[start] ^= 0xFF
    (tmp / "crc.pt2").write_bytes(bytes(damaged))
    cases["crc"] = (tmp / "crc.pt2", "CRC")
    return cases


CASES = ["truncated", "not an export", "zip bomb", "unexpected member", "pickled weight",
         "pickled extra", "evil sample inputs", "two roots", "short payload", "wrong format",
         "crc"]


@pytest.mark.parametrize("case", CASES)
def test_malformed_archives_are_4xx_and_store_nothing(api: TestClient, pt2: Path,
                                                      tmp_path: Path, case: str) -> None:
    path, expected = _bad_archives(pt2, tmp_path)[case]
    response = _upload(api, path)
    assert response.status_code == 422, response.text
    assert expected in response.json()["message"]
    assert api.get("/v1/models").json() == []
    assert not (tmp_path / "pwned").exists()


def test_the_evil_pickle_is_real(pt2: Path, tmp_path: Path) -> None:
    """The sample inputs the API refuses would run code if torch loaded them unchecked."""
    import torch

    path, _ = _bad_archives(pt2, tmp_path)["evil sample inputs"]
    with zipfile.ZipFile(path) as archive:
        inner = archive.read(f"{root_of({n: b'' for n in archive.namelist()})}/data/"
                             f"sample_inputs/model.pt")
    import io

    torch.load(io.BytesIO(inner), weights_only=False)
    assert (tmp_path / "pwned").exists()


def test_pickle_scan_follows_memo_and_stack_global() -> None:
    import os
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    for protocol in (2, 4, 5):
        with pytest.raises(InvalidModel, match=r"calls (posix|os)\.system"):
            check_pickle_ops(pickle.dumps([Evil(), Evil()], protocol=protocol), what="x")
    check_pickle_ops(pickle.dumps({"a": (1, 2.0, "s")}, protocol=4), what="plain data")


def test_multipart_with_a_pt2_is_refused(api: TestClient, pt2: Path) -> None:
    response = api.post("/v1/models", files=[("file", ("model.onnx", b"x")),
                                             ("file", ("tiny.pt2", pt2.read_bytes()))])
    assert response.status_code == 422
    assert "alone" in response.json()["message"]


UPLOAD_WITHOUT_TORCH = BLOCKER + """
import sys
from fastapi.testclient import TestClient
from services.api.app import create_app
from services.api.auth import Role, mint_token
from services.config import KilnSettings
settings = KilnSettings(home=sys.argv[1], env="dev")
app = create_app(settings)
with TestClient(app) as client:
    client.headers["Authorization"] = "Bearer " + mint_token(
        settings.secret_key, role=Role.ADMIN, subject="t", ttl_s=600)
    response = client.post("/v1/models", files={"file": ("m.pt2", open(sys.argv[2], "rb").read())})
    assert response.status_code == 201, response.text
    print(response.json()["format"])
assert "torch" not in sys.modules
"""


def test_the_api_checks_a_pt2_without_torch(pt2: Path, tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-c", UPLOAD_WITHOUT_TORCH, str(tmp_path),
                             str(pt2)], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).parents[3])
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "torch-export"


def test_program_json_is_read_not_trusted(pt2: Path, tmp_path: Path) -> None:
    def no_inputs(m: dict[str, bytes]) -> dict[str, bytes]:
        name = f"{root_of(m)}/models/model.json"
        program = json.loads(m[name])
        program["graph_module"]["signature"]["input_specs"] = [
            s for s in program["graph_module"]["signature"]["input_specs"]
            if "user_input" not in s]
        return {**m, name: json.dumps(program).encode()}

    with pytest.raises(InvalidModel, match="0 tensor inputs"):
        inspect_export_archive(rewrite(pt2, tmp_path / "n.pt2", no_inputs))


def test_a_job_goes_only_to_keys_whose_workers_take_the_format(
        api: TestClient, settings, pt2: Path) -> None:
    from kiln.examples import mlp
    from schemas.fingerprint import CpuInfo, HardwareFingerprint
    from services.db import make_engine, make_session_factory, repo, session_scope

    ort, aoti = "ort-cpu-x86-64-v3-ort1.32", "aoti-cpu-x86-64-v3-torch2.13"
    factory = make_session_factory(make_engine(settings.database_url))
    with session_scope(factory) as session:
        repo.heartbeat_worker(session, name="w", fingerprint_keys=[ort, aoti],
                              fingerprint=HardwareFingerprint(cpu=CpuInfo(arch="x86_64")),
                              model_formats={ort: ["onnx"], aoti: ["torch-export"]})
    program = _upload(api, pt2).json()["id"]
    onnx_model = api.post("/v1/models", files={"file": ("m.onnx", mlp().SerializeToString())})
    refused = api.post("/v1/compile-jobs", json={
        "model_id": program, "targets": [{"fingerprint_key": ort}]})
    assert refused.status_code == 422, refused.text
    assert f"torch-export models: ['{aoti}']" in refused.json()["message"]
    refused = api.post("/v1/compile-jobs", json={
        "model_id": onnx_model.json()["id"], "targets": [{"fingerprint_key": aoti}]})
    assert refused.status_code == 422 and f"onnx models: ['{ort}']" in refused.json()["message"]
    assert api.get("/v1/compile-jobs").json() == []
    accepted = api.post("/v1/compile-jobs", json={
        "model_id": program, "targets": [{"fingerprint_key": aoti}]})
    assert accepted.status_code == 202, accepted.text
    # A key no live worker describes is not refused: its job waits for hardware.
    waiting = api.post("/v1/compile-jobs", json={
        "model_id": program, "targets": [{"fingerprint_key": "aoti-cpu-x86-64-v4-torch2.13"}]})
    assert waiting.json()["jobs"][0]["status"] == "waiting_for_hardware"

"""POST /v1/models with external data: one archive, several files, or a plain .onnx."""

from __future__ import annotations

import hashlib
import tarfile
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from artifact_store.model_archive import pack_model_files
from kiln.model_files import data_files_beside
from tests.models.external_data import external_cnn, regular, symlink, tar_bytes, with_location


def _canonical(model_path: Path, tmp_path: Path) -> bytes:
    pack_model_files(model_path, data_files_beside(model_path), tmp_path / "canonical")
    return (tmp_path / "canonical").read_bytes()


def test_archive_upload_stores_the_canonical_archive(api: TestClient, tmp_path: Path) -> None:
    model_path = external_cnn(tmp_path / "m")
    user = tmp_path / "user.tar"
    with tarfile.open(user, "w") as tar:  # the user's own archive: real mtimes, any order
        tar.add(model_path.parent / "model.onnx.data", arcname="model.onnx.data")
        tar.add(model_path, arcname="cnn.onnx")
    response = api.post("/v1/models", files={"file": ("cnn.tar", user.read_bytes(),
                                                      "application/x-tar")})
    assert response.status_code == 201, response.text
    info = response.json()
    canonical = _canonical(model_path, tmp_path)
    assert info["id"] == hashlib.sha256(canonical).hexdigest()
    assert info["size_bytes"] == len(canonical)
    assert info["name"] == "cnn"
    assert info["opset"] == 17
    assert [i["name"] for i in info["inputs"]] == ["image"]


def test_multipart_files_and_archive_are_the_same_model(api: TestClient, tmp_path: Path) -> None:
    model_path = external_cnn(tmp_path / "m")
    data = model_path.parent / "model.onnx.data"
    multipart = api.post("/v1/models", files=[
        ("file", ("model.onnx", model_path.read_bytes(), "application/octet-stream")),
        ("file", ("model.onnx.data", data.read_bytes(), "application/octet-stream")),
    ])
    assert multipart.status_code == 201, multipart.text
    archive = api.post("/v1/models", files={"file": (
        "x.bin", _canonical(model_path, tmp_path), "application/octet-stream")})
    assert archive.status_code == 200  # detected by content, the same model
    assert archive.json()["id"] == multipart.json()["id"]
    changed = external_cnn(tmp_path / "other", seed=7)
    other = api.post("/v1/models", files=[
        ("file", ("model.onnx", changed.read_bytes())),
        ("file", ("model.onnx.data", (changed.parent / "model.onnx.data").read_bytes())),
    ])
    assert other.status_code == 201
    assert other.json()["id"] != multipart.json()["id"]


def test_onnx_without_its_data_names_the_missing_file(api: TestClient, tmp_path: Path) -> None:
    model_path = external_cnn(tmp_path / "m")
    response = api.post("/v1/models", files={"file": ("model.onnx", model_path.read_bytes())})
    assert response.status_code == 422
    body = response.json()
    assert "model.onnx.data" in body["message"]
    assert body["details"]["missing_files"] == ["model.onnx.data"]
    assert api.get("/v1/models").json() == []


def _hostile_uploads(tmp_path: Path) -> dict[str, list]:
    model_path = external_cnn(tmp_path / "m")
    model = model_path.read_bytes()
    data = (model_path.parent / "model.onnx.data").read_bytes()
    passwd = with_location(model_path, "../../etc/passwd")
    return {
        "dotdot member": [("file", ("m.tar", tar_bytes([regular("model.onnx", model),
                                                        regular("../x", data)])))],
        "symlink member": [("file", ("m.tar", tar_bytes([
            regular("model.onnx", model), symlink("model.onnx.data", "/etc/passwd")])))],
        "passwd location": [("file", ("m.tar", tar_bytes([regular("model.onnx", passwd),
                                                          regular("model.onnx.data", data)])))],
        "offset beyond": [("file", ("m.tar", tar_bytes([
            regular("model.onnx", with_location(model_path, "model.onnx.data",
                                                offset=len(data))),
            regular("model.onnx.data", data)])))],
        "multipart dotdot name": [("file", ("model.onnx", model)),
                                  ("file", ("../model.onnx.data", data))],
        "multipart two models": [("file", ("a.onnx", model)), ("file", ("b.onnx", model))],
        "multipart passwd location": [("file", ("model.onnx", passwd)),
                                      ("file", ("model.onnx.data", data))],
        "oversized": [("file", ("model.onnx", model)),
                      ("file", ("model.onnx.data", data + b"\0" * (4 * 1024 * 1024)))],
    }


@pytest.mark.parametrize("case", ["dotdot member", "symlink member", "passwd location",
                                  "offset beyond", "multipart dotdot name",
                                  "multipart two models", "multipart passwd location",
                                  "oversized"])
def test_hostile_uploads_are_4xx(api: TestClient, tmp_path: Path, case: str) -> None:
    response = api.post("/v1/models", files=_hostile_uploads(tmp_path)[case])
    assert 400 <= response.status_code < 500, response.text
    assert response.json()["message"]
    assert api.get("/v1/models").json() == []


def test_sdk_uploads_the_onnx_with_its_data_files(api: TestClient, tmp_path: Path) -> None:
    from kiln.client import KilnClient

    model_path = external_cnn(tmp_path / "m")
    client = KilnClient("http://testserver", None)
    client.http = api  # the SDK's requests go to the real app in-process
    info = client.upload_model(model_path, name="cnn")
    assert info.id == hashlib.sha256(_canonical(model_path, tmp_path)).hexdigest()
    (model_path.parent / "model.onnx.data").unlink()
    from schemas.errors import InvalidModel

    with pytest.raises(InvalidModel, match="not beside it"):
        client.upload_model(model_path)



def test_an_upload_waiting_for_the_database_leaves_the_api_answering(
        api: TestClient, settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's row is written in a thread. While another connection holds SQLite's write
    lock (the embedded stack's workers share the file), the upload waits for it and the API
    keeps answering. Written on the event loop, the statement froze the loop for the whole
    busy timeout, and a request whose transaction only that loop could end held the lock
    meanwhile: a 503 after 30 s, seen in CI. (The real ``upsert_model`` runs; the wrapper
    only holds it until the lock is taken, so that the upload's earlier reads are done.)"""
    import sqlite3
    import threading

    from kiln.examples import mlp
    from services.api.routers import models as route

    reached, locked = threading.Event(), threading.Event()
    real = route.repo.upsert_model

    def upsert_once_locked(*args, **kwargs):
        reached.set()
        locked.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(route.repo, "upsert_model", upsert_once_locked)
    answers: dict[str, object] = {}
    upload = threading.Thread(target=lambda: answers.setdefault("upload", api.post(
        "/v1/models", files={"file": ("m.onnx", mlp(seed=7).SerializeToString())})))
    upload.start()
    assert reached.wait(60), "the upload never reached its row"
    holder = sqlite3.connect(settings.database_url.removeprefix("sqlite:///"),
                             isolation_level=None, timeout=30)
    holder.execute("BEGIN IMMEDIATE")  # SQLite's one write lock, held here
    try:
        locked.set()
        probe = threading.Thread(target=lambda: answers.setdefault("probe",
                                                                   api.get("/healthz")))
        probe.start()
        probe.join(10)
        assert not probe.is_alive(), "the API stopped answering while an upload waited"
        assert answers["probe"].status_code == 200
        assert "upload" not in answers  # it is still waiting for the lock
    finally:
        locked.set()
        holder.execute("ROLLBACK")
        holder.close()
    upload.join(60)
    assert answers["upload"].status_code == 201, answers["upload"].text

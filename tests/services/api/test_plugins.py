"""``/v1/plugins`` against the local store: push, list, download, and bad bundles."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from artifact_store.bundles import pack_bundle

MANIFEST = {
    "name": "swish", "version": "1.0.0",
    "ops": [{"domain": "kiln.test", "op_type": "Swish",
             "inputs": [{"name": "x", "dtypes": ["float32"]}],
             "outputs": [{"name": "y", "dtypes": ["float32"]}],
             "shape_function": "swish:shape"}],
    "implementations": [{"ops": ["kiln.test::Swish"], "kind": "python",
                         "entry": "swish:kernel"}],
}
MODULE = "def shape(inputs, attributes):\n    return inputs\n\n" \
         "def kernel(ctx, inputs, outputs, attributes):\n    pass\n"


def make_bundle(tmp: Path, manifest: dict | None = None, *, name: str = "b") -> Path:
    src = tmp / name
    src.mkdir()
    (src / "plugin.json").write_text(json.dumps(manifest or MANIFEST))
    (src / "swish.py").write_text(MODULE)
    archive = tmp / f"{name}.tar"
    pack_bundle(src, archive)
    return archive


def push(api, data: bytes):
    return api.post("/v1/plugins", files={"file": ("bundle.tar", data)})


def raw_tar(entries: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in entries.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_push_list_get_download(api, tmp_path):
    data = make_bundle(tmp_path).read_bytes()
    created = push(api, data)
    assert created.status_code == 201, created.text
    info = created.json()
    assert info["digest"] == hashlib.sha256(data).hexdigest()
    assert info["ops"] == ["kiln.test::Swish"]
    assert push(api, data).status_code == 200  # the same bundle again
    assert [p["name"] for p in api.get("/v1/plugins").json()] == ["swish"]
    assert api.get("/v1/plugins/swish/1.0.0").json()["digest"] == info["digest"]
    assert api.get("/v1/plugins/swish/1.0.0/bundle").content == data
    ranged = api.get("/v1/plugins/swish/1.0.0/bundle", headers={"Range": "bytes=10-19"})
    assert ranged.status_code == 206 and ranged.content == data[10:20]


def test_a_version_is_immutable(api, tmp_path):
    assert push(api, make_bundle(tmp_path).read_bytes()).status_code == 201
    changed = {**MANIFEST, "description": "changed"}
    conflict = push(api, make_bundle(tmp_path, changed, name="c").read_bytes())
    assert conflict.status_code == 409 and "immutable" in conflict.json()["message"]
    missing = api.get("/v1/plugins/swish/9.9.9")
    assert missing.status_code == 404 and "1.0.0" in missing.json()["message"]


@pytest.mark.parametrize(
    ("entries", "needle"),
    [
        ({"plugin.json": json.dumps(MANIFEST).encode(), "../evil.py": b"x"}, "escapes"),
        ({"plugin.json": b"{not json"}, "not a valid plugin manifest"),
        ({"swish.py": MODULE.encode()}, "no plugin.json"),
        ({"plugin.json": json.dumps(MANIFEST).encode()}, "does not contain"),
        ({"plugin.json": json.dumps({**MANIFEST, "files": [
            {"path": "swish.py", "sha256": "0" * 64, "size": len(MODULE)}]}).encode(),
          "swish.py": MODULE.encode()}, "sha256"),
    ],
    ids=["path-escape", "bad-json", "no-manifest", "missing-file", "wrong-digest"],
)
def test_bad_bundles_are_refused_and_nothing_is_recorded(api, entries, needle):
    response = push(api, raw_tar(entries))
    assert 400 <= response.status_code < 500, response.text
    assert needle in response.json()["message"]
    assert api.get("/v1/plugins").json() == []


def test_not_a_tar_and_empty(api):
    assert push(api, b"plain bytes").status_code == 400
    assert push(api, b"").status_code == 400


def test_a_newer_plugin_version_is_no_cache_hit_for_old_artifacts(api, settings, tmp_path):
    from kiln.examples import mlp
    from schemas.plugins import PluginRef
    from services.db import make_engine, make_session_factory, repo, session_scope
    from tests.services.api.test_api import upload
    from tests.services.api.test_recovery import published
    from tests.services.db.helpers import manifest

    key = "ort-cpu-x86-64-v4-ort1.32"
    first = push(api, make_bundle(tmp_path).read_bytes()).json()
    model_id = upload(api, mlp().SerializeToString()).json()["id"]
    factory = make_session_factory(make_engine(settings.database_url))
    built = manifest(model_id, fingerprint_key=key).model_copy(update={"plugins": [
        PluginRef(name="swish", version="1.0.0", digest=first["digest"])]})
    published(settings, built, tmp_path)  # a cache hit needs its blobs in the store
    with session_scope(factory) as session:
        repo.record_artifact(session, model_id=model_id, manifest=built)

    def job() -> dict:
        return api.post("/v1/compile-jobs", json={
            "model_id": model_id, "targets": [{"fingerprint_key": key}]}).json()["jobs"][0]

    assert job()["cache_hit"]
    push(api, make_bundle(tmp_path, {**MANIFEST, "version": "1.1.0"}, name="v2").read_bytes())
    again = job()
    assert not again["cache_hit"] and again["status"] == "waiting_for_hardware"


def test_a_newer_plugin_version_rebuilds_deployed_engines_while_the_old_one_serves(
        api, settings, tmp_path):
    from kiln.examples import mlp
    from schemas.plugins import PluginRef
    from services.db import make_engine, make_session_factory, repo, session_scope
    from tests.services.api.test_api import upload
    from tests.services.api.test_fleet import KEY, beat, deploy, register
    from tests.services.db.helpers import manifest

    first = push(api, make_bundle(tmp_path).read_bytes()).json()
    model_id = upload(api, mlp().SerializeToString()).json()["id"]
    factory = make_session_factory(make_engine(settings.database_url))

    def record(plugin: dict, toolchain: str) -> str:
        built = manifest(model_id, fingerprint_key=KEY, toolchain=toolchain).model_copy(
            update={"plugins": [PluginRef(name="swish", version=plugin["version"],
                                          digest=plugin["digest"])]})
        with session_scope(factory) as session:
            return repo.record_artifact(session, model_id=model_id, manifest=built)[0].id

    def desired() -> dict:
        (model,) = beat(api, "node")["models"]
        return model

    old = record(first, "ort+swish-1.0.0")
    register(api, "node", {"site": "a"})
    assert deploy(api, "svc", model_id, {"site": "a"}).status_code == 201
    assert (desired()["artifact_id"], desired()["tier"], desired()["job_id"]) == (old, "exact",
                                                                                  None)

    newer = push(api, make_bundle(tmp_path, {**MANIFEST, "version": "1.1.0"},
                                  name="v2").read_bytes()).json()
    now = desired()
    assert (now["artifact_id"], now["tier"]) == (old, "exact")  # keeps serving meanwhile
    rebuild = api.get(f"/v1/compile-jobs/{now['job_id']}").json()
    assert rebuild["fingerprint_key"] == KEY and rebuild["status"] == "waiting_for_hardware"
    assert desired()["job_id"] == now["job_id"]  # one rebuild, not one per heartbeat

    new = record(newer, "ort+swish-1.1.0")
    assert (desired()["artifact_id"], desired()["job_id"]) == (new, None)

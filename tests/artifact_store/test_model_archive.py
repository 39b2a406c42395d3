"""Model archives: canonical packing, content ids, confined unpacking, hostile archives."""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import numpy as np
import onnx
import pytest

from artifact_store.model_archive import (
    canonical_model_blob,
    pack_model_files,
    unpack_model_archive,
)
from kiln.model_files import data_files_beside
from schemas.errors import InvalidModel, ModelTooLarge
from schemas.onnx_model import (
    MODEL_ARCHIVE_MEDIA_TYPE,
    ONNX_MEDIA_TYPE,
    is_tar,
    load_model_bytes,
)
from tests.models.external_data import (
    external_cnn,
    regular,
    symlink,
    tar_bytes,
    with_location,
)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _pack(model_path: Path, dest: Path) -> Path:
    pack_model_files(model_path, data_files_beside(model_path), dest)
    return dest


def test_canonical_archive_is_deterministic_and_holds_model_and_data(tmp_path: Path) -> None:
    model_path = external_cnn(tmp_path / "a")
    first = _pack(model_path, tmp_path / "first.tar")
    (model_path.parent / "model.onnx.data").touch()  # a new mtime changes nothing
    second = _pack(model_path, tmp_path / "second.tar")
    assert first.read_bytes() == second.read_bytes()
    assert is_tar(first.read_bytes())
    with tarfile.open(first) as tar:
        members = tar.getmembers()
    assert [m.name for m in members] == ["model.onnx", "model.onnx.data"]
    assert {(m.mtime, m.uid, m.gid, m.mode, m.uname) for m in members} == {(0, 0, 0, 0o644, "")}


def test_same_model_and_data_same_id_however_uploaded(tmp_path: Path) -> None:
    model_path = external_cnn(tmp_path / "src")
    canonical = _pack(model_path, tmp_path / "canonical.tar")
    # The user's own tar: other order, real mtimes, a directory entry, the model renamed.
    user = tmp_path / "user.tar"
    with tarfile.open(user, "w") as tar:
        tar.add(model_path.parent / "model.onnx.data", arcname="model.onnx.data")
        tar.add(model_path, arcname="cnn.onnx")
    _, media_type = canonical_model_blob(user, tmp_path / "from_user")
    assert media_type == MODEL_ARCHIVE_MEDIA_TYPE
    assert _sha(tmp_path / "from_user") == _sha(canonical)


def test_changed_data_changes_the_id(tmp_path: Path) -> None:
    one = _pack(external_cnn(tmp_path / "one", seed=0), tmp_path / "one.tar")
    two = _pack(external_cnn(tmp_path / "two", seed=1), tmp_path / "two.tar")
    assert _sha(one) != _sha(two)


def test_self_contained_model_is_stored_as_plain_onnx(tmp_path: Path) -> None:
    from kiln.examples import small_cnn

    data = small_cnn().SerializeToString()
    (tmp_path / "m.onnx").write_bytes(data)
    archive = tmp_path / "m.tar"
    archive.write_bytes(tar_bytes([regular("m.onnx", data)]))
    for source in (tmp_path / "m.onnx", archive):
        _, media_type = canonical_model_blob(source, tmp_path / "blob")
        assert media_type == ONNX_MEDIA_TYPE
        assert (tmp_path / "blob").read_bytes() == data


def test_unpack_round_trip_loads_the_weights(tmp_path: Path) -> None:
    model_path = external_cnn(tmp_path / "src")
    archive = _pack(model_path, tmp_path / "m.tar")
    unpacked = unpack_model_archive(archive, tmp_path / "out")
    assert unpacked == (tmp_path / "out" / "model.onnx").resolve()
    loaded = onnx.load(str(unpacked))
    original = onnx.load(str(model_path))
    assert [onnx.numpy_helper.to_array(t).tobytes() for t in loaded.graph.initializer] == [
        onnx.numpy_helper.to_array(t).tobytes() for t in original.graph.initializer]
    graph = load_model_bytes(archive.read_bytes())  # only the graph: tensors stay external
    assert graph.graph.initializer[0].data_location == onnx.TensorProto.EXTERNAL


def _model_and_data(tmp_path: Path) -> tuple[Path, bytes]:
    model_path = external_cnn(tmp_path / "src")
    return model_path, (model_path.parent / "model.onnx.data").read_bytes()


def _hostile(tmp_path: Path) -> dict[str, tuple[bytes, str]]:
    model_path, data = _model_and_data(tmp_path)
    model = model_path.read_bytes()
    big_offset = with_location(model_path, "model.onnx.data", offset=len(data))
    return {
        "dotdot member": (tar_bytes([regular("model.onnx", model), regular("../x", data)]),
                          "not a relative path confined"),
        "absolute member": (tar_bytes([regular("model.onnx", model),
                                       regular("/tmp/model.onnx.data", data)]),
                            "not a relative path confined"),
        "symlink member": (tar_bytes([regular("model.onnx", model),
                                      symlink("model.onnx.data", "/etc/passwd")]),
                           "is a link"),
        "location ../../etc/passwd": (
            tar_bytes([regular("model.onnx", with_location(model_path, "../../etc/passwd")),
                       regular("model.onnx.data", data)]), "not a relative path confined"),
        "absolute location": (
            tar_bytes([regular("model.onnx", with_location(model_path, "/etc/passwd")),
                       regular("model.onnx.data", data)]), "not a relative path confined"),
        "offset beyond the file": (
            tar_bytes([regular("model.onnx", big_offset), regular("model.onnx.data", data)]),
            "which has .* bytes; expected offset \\+ length within the file"),
        "missing data file": (tar_bytes([regular("model.onnx", model)]),
                              r"\['model.onnx.data'\], which were not uploaded"),
        "two models": (tar_bytes([regular("a.onnx", model), regular("b.onnx", model),
                                  regular("model.onnx.data", data)]),
                       "holds 2 .onnx files"),
        "duplicate member": (tar_bytes([regular("model.onnx", model),
                                        regular("model.onnx.data", data),
                                        regular("./model.onnx.data", data)]), "appears twice"),
        "too many members": (tar_bytes([regular("model.onnx", model)]
                                       + [regular(f"f{i}", b"") for i in range(10_001)]),
                             "more than 10000 members"),
        "not a tar": (b"\0" * 257 + b"ustar" + b"\xff" * 300, "not a readable tar"),
    }


HOSTILE = ["dotdot member", "absolute member", "symlink member", "location ../../etc/passwd",
           "absolute location", "offset beyond the file", "missing data file", "two models",
           "duplicate member", "too many members", "not a tar"]


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_archives_are_refused_typed_and_nothing_escapes(tmp_path: Path,
                                                                case: str) -> None:
    blob, message = _hostile(tmp_path)[case]
    archive = tmp_path / "hostile.tar"
    archive.write_bytes(blob)
    with pytest.raises(InvalidModel, match=message):
        canonical_model_blob(archive, tmp_path / "blob")
    with pytest.raises(InvalidModel, match=message):
        unpack_model_archive(io.BytesIO(blob), tmp_path / "jail" / "out")
    with pytest.raises(InvalidModel, match=message):
        load_model_bytes(blob)
    assert not (tmp_path / "x").exists() and not (tmp_path / "jail" / "x").exists()


def test_oversized_archive_is_model_too_large(tmp_path: Path) -> None:
    model_path, data = _model_and_data(tmp_path)
    archive = tmp_path / "big.tar"
    archive.write_bytes(tar_bytes([regular("model.onnx", model_path.read_bytes()),
                                   regular("model.onnx.data", data)]))
    with pytest.raises(ModelTooLarge, match="over 1000 bytes"):
        canonical_model_blob(archive, tmp_path / "blob", max_bytes=1000)
    with pytest.raises(ModelTooLarge):
        unpack_model_archive(archive, tmp_path / "out", max_bytes=1000)


def test_length_that_disagrees_with_the_tensor_is_refused(tmp_path: Path) -> None:
    model_path, data = _model_and_data(tmp_path)
    archive = tmp_path / "m.tar"
    archive.write_bytes(tar_bytes([
        regular("model.onnx", with_location(model_path, "model.onnx.data", length=4)),
        regular("model.onnx.data", data)]))
    with pytest.raises(InvalidModel, match="dtype and dims need"):
        canonical_model_blob(archive, tmp_path / "blob")


def test_data_files_beside_refuses_escaping_locations(tmp_path: Path) -> None:
    model_path, _ = _model_and_data(tmp_path)
    (tmp_path / "outside.data").write_bytes(np.zeros(10_000, np.float32).tobytes())
    (model_path.parent / "link.data").symlink_to(tmp_path / "outside.data")
    for location, message in [("../outside.data", "not a relative path confined"),
                              ("link.data", "resolves outside"),
                              ("absent.data", "not beside it")]:
        bad = model_path.parent / "bad.onnx"
        bad.write_bytes(with_location(model_path, location))
        with pytest.raises(InvalidModel, match=message):
            data_files_beside(bad)

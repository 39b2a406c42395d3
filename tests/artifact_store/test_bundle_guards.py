"""The plugin bundle reader refuses link members and archives that unpack beyond the limit,
before anything is extracted or its files are read."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from artifact_store import bundles
from artifact_store.bundles import pack_bundle, read_bundle
from schemas.errors import InvalidRequest

MANIFEST = {
    "name": "swish", "version": "1.0.0",
    "ops": [{"domain": "kiln.test", "op_type": "Swish",
             "inputs": [{"name": "x", "dtypes": ["float32"]}],
             "outputs": [{"name": "y", "dtypes": ["float32"]}],
             "shape_function": "swish:shape"}],
    "implementations": [{"ops": ["kiln.test::Swish"], "kind": "python",
                         "entry": "swish:kernel"}],
}
MODULE = b"def shape(inputs, attributes):\n    return inputs\n\n" \
         b"def kernel(ctx, inputs, outputs, attributes):\n    pass\n"


def good_bundle(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    (src / "plugin.json").write_text(json.dumps(MANIFEST))
    (src / "swish.py").write_bytes(MODULE)
    archive = tmp_path / "good.tar"
    pack_bundle(src, archive)
    return archive


def with_member(archive: Path, dest: Path, member: tarfile.TarInfo,
                data: bytes | None = None) -> Path:
    """``archive`` with ``member`` appended."""
    buffer = io.BytesIO(archive.read_bytes())
    with tarfile.open(fileobj=buffer, mode="a") as tar:
        tar.addfile(member, io.BytesIO(data) if data is not None else None)
    dest.write_bytes(buffer.getvalue())
    return dest


def test_a_good_bundle_reads(tmp_path):
    assert read_bundle(good_bundle(tmp_path)).name == "swish"


@pytest.mark.parametrize("kind", [tarfile.SYMTYPE, tarfile.LNKTYPE], ids=["symlink", "hardlink"])
def test_link_members_are_refused(tmp_path, kind):
    link = tarfile.TarInfo("swish_link.py")
    link.type = kind
    link.linkname = "/etc/passwd" if kind == tarfile.SYMTYPE else "swish.py"
    archive = with_member(good_bundle(tmp_path), tmp_path / "linked.tar", link)
    with pytest.raises(InvalidRequest, match="not a regular file"):
        read_bundle(archive)


def test_an_archive_unpacking_beyond_the_limit_is_refused(tmp_path, monkeypatch):
    archive = good_bundle(tmp_path)
    with tarfile.open(archive) as tar:
        size = sum(m.size for m in tar.getmembers())
    monkeypatch.setattr(bundles, "MAX_UNPACKED_BYTES", size - 1)
    with pytest.raises(InvalidRequest, match=f"unpacks beyond {size - 1} bytes"):
        read_bundle(archive)
    monkeypatch.setattr(bundles, "MAX_UNPACKED_BYTES", size)
    assert read_bundle(archive).name == "swish"  # exactly at the limit is fine

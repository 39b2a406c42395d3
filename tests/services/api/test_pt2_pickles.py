"""A ``.pt2``'s sample inputs are a pickle: the upload check allows only the opcodes and
globals ``torch.save`` writes for plain tensors, reading the unpickler's stack and memo as
they would be, so no trick (``POP``, ``POP_MARK``, ``DUP``, the memo, ``INST``, names with
newlines, a pickle inside a pickle) gets a call past it. Nothing here unpickles the hostile
bytes except ``test_the_red_team_pickle_is_real``, on a marker file."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from schemas.errors import InvalidModel
from schemas.torch_export import check_pickle_ops, inspect_export_archive
from tests.models.hostile_pickles import (
    TRICKS,
    assert_would_run,
    pop_trick,
    with_sample_inputs_pickle,
)
from tests.models.torch_programs import kthvalue_archive, save_program, tiny_mlp_archive


@pytest.fixture(scope="module")
def pt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_mlp_archive(tmp_path_factory.mktemp("pt2") / "tiny.pt2")


def test_the_red_team_pickle_is_real(tmp_path: Path) -> None:
    """Loaded, it runs its command: what the check refuses is an attack, not a false alarm."""
    assert_would_run(pop_trick(tmp_path / "ran"), tmp_path / "ran")


def test_the_red_team_pt2_is_refused_at_upload_naming_the_global(
        api: TestClient, pt2: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    hostile = with_sample_inputs_pickle(pt2, tmp_path / "hostile.pt2", pop_trick(marker))
    response = api.post("/v1/models", files={"file": ("hostile.pt2", hostile.read_bytes())})
    assert response.status_code == 422, response.text
    body = response.json()
    assert body["code"] == "invalid_model"
    assert "calls posix.system (STACK_GLOBAL at byte" in body["message"], body
    assert body["details"]["pickle_global"] == "posix.system"
    assert api.get("/v1/models").json() == []
    assert not marker.exists()


@pytest.mark.parametrize("trick", sorted(TRICKS))
def test_every_trick_is_refused_naming_the_global_or_opcode(
        pt2: Path, tmp_path: Path, trick: str) -> None:
    build, named = TRICKS[trick]
    data = build(tmp_path / "ran")
    with pytest.raises(InvalidModel) as err:
        check_pickle_ops(data, what="the sample inputs")
    assert named in err.value.message, err.value.message
    assert named in err.value.details.get("pickle_global", "") or \
        named == err.value.details.get("pickle_opcode"), err.value.details
    # and inside a real archive, by the whole structural check
    hostile = with_sample_inputs_pickle(pt2, tmp_path / "hostile.pt2", data)
    with pytest.raises(InvalidModel, match="sample inputs may only rebuild plain tensors"):
        inspect_export_archive(hostile)
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("data", [
    b"\x80\x02X\x01\x00\x00\x00a\x93.",  # STACK_GLOBAL with one operand
    b"\x80\x02h\x05.",  # GET of a memo entry never stored
    b"\x80\x02(t0.",  # the only item popped: STOP finds no result
    b"\x80\x02N\x85)",  # no STOP
    b"\x80\x02K\x01K\x02.",  # two results
    b"\x80\x02\x82\x01.",  # EXT1
], ids=["stack-global-underflow", "unknown-memo", "stop-with-nothing", "no-stop", "two-results",
        "ext1"])
def test_malformed_or_unaccountable_streams_are_refused(data: bytes) -> None:
    with pytest.raises(InvalidModel):
        check_pickle_ops(data, what="x")


def test_plain_data_and_what_torch_save_writes_still_pass(tmp_path: Path) -> None:
    import io

    import torch

    check_pickle_ops(pickle.dumps({"a": [1, 2.0, "s", None, True]}, protocol=2), what="x")
    check_pickle_ops(pickle.dumps({"a": (b"b", {1, 2}, frozenset())}, protocol=4), what="x")
    samples = ((torch.randn(2, 3), torch.arange(4), torch.zeros(2, dtype=torch.bool),
                torch.ones(3, dtype=torch.float16), torch.ones(2, dtype=torch.bfloat16),
                torch.nn.Parameter(torch.ones(2)), torch.randn(4, 4)[:, 1]),
               {"k": torch.ones(1, dtype=torch.int8)})
    for protocol in (2, 4):
        buffer = io.BytesIO()
        torch.save(samples, buffer, pickle_protocol=protocol)
        with __import__("zipfile").ZipFile(buffer) as archive:
            name = next(n for n in archive.namelist() if n.endswith("data.pkl"))
            check_pickle_ops(archive.read(name), what=f"torch.save, protocol {protocol}")


def test_legitimate_programs_pass(tmp_path: Path) -> None:
    import torch

    for path in (tiny_mlp_archive(tmp_path / "mlp.pt2"), kthvalue_archive(tmp_path / "k.pt2"),
                 save_program(torch.nn.Linear(3, 2), (torch.randn(4, 3),), tmp_path / "d.pt2",
                              dynamic_shapes=({0: torch.export.Dim("b", min=1, max=8)},))):
        assert inspect_export_archive(path).inputs

"""The worker's side of a ``.pt2``: the same pickle check as the API, and a load that can never
fall back to an unpickling able to run code (torch 2.13's ``deserialize_torch_artifact``
retries a failed weights-only load of the sample inputs with ``weights_only=False``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from compiler_worker import torch_program
from compiler_worker.torch_program import load_program, safe_export_load
from schemas.errors import InvalidModel
from schemas.torch_export import inspect_export_archive
from tests.models.hostile_pickles import TRICKS, pop_trick, with_sample_inputs_pickle
from tests.models.torch_programs import (
    kthvalue_archive,
    pickled_weight,
    rewrite,
    tiny_mlp_archive,
)


@pytest.fixture(scope="module")
def pt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_mlp_archive(tmp_path_factory.mktemp("pt2") / "tiny.pt2")


@pytest.fixture
def unchecked(monkeypatch: pytest.MonkeyPatch, pt2: Path) -> None:
    """The structural check made to pass everything (as if it missed a trick): what stands
    between the archive and the worker is the load alone."""
    clean = inspect_export_archive(pt2)
    monkeypatch.setattr(torch_program, "inspect_export_archive", lambda path: clean)


@pytest.mark.parametrize("trick", ["pop", "memo", "inst", "nested pickle"])
def test_the_worker_side_check_refuses_the_hostile_pickles(pt2: Path, tmp_path: Path,
                                                          trick: str) -> None:
    build, named = TRICKS[trick]
    marker = tmp_path / "ran"
    hostile = with_sample_inputs_pickle(pt2, tmp_path / "hostile.pt2", build(marker))
    with pytest.raises(InvalidModel, match="sample inputs may only rebuild plain tensors") as err:
        load_program(hostile)
    assert named in err.value.message
    assert not marker.exists()


def test_the_load_never_falls_back_to_weights_only_false(pt2: Path, tmp_path: Path,
                                                         unchecked: None) -> None:
    """Past the check, torch's weights-only load of the red team's sample inputs fails and
    torch retries with ``weights_only=False``: that retry is refused, and the command never
    runs."""
    marker = tmp_path / "ran"
    hostile = with_sample_inputs_pickle(pt2, tmp_path / "hostile.pt2", pop_trick(marker))
    with pytest.raises(InvalidModel) as err:
        load_program(hostile)
    assert not marker.exists(), "the archive's pickle ran a command on the worker"
    assert "torch.load(weights_only=False)" in err.value.message
    assert err.value.details["unsafe_load"] == "torch.load(weights_only=False)"


def test_a_pickled_weight_past_the_check_is_refused_by_the_load(pt2: Path, tmp_path: Path,
                                                                unchecked: None) -> None:
    with pytest.raises(InvalidModel, match="weights_only=False"):
        safe_export_load(rewrite(pt2, tmp_path / "pickled.pt2", pickled_weight))


def test_legitimate_programs_load_and_torch_is_left_as_it_was(tmp_path: Path) -> None:
    import os

    import torch

    load, env = torch.load, os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    for path in (tiny_mlp_archive(tmp_path / "mlp.pt2"), kthvalue_archive(tmp_path / "k.pt2")):
        loaded = load_program(path)
        args, _ = loaded.program.example_inputs
        assert loaded.program.module()(*args).shape[0] == 4
    assert torch.load is load and os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD") == env

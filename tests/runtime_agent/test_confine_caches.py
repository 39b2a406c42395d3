"""A confined agent writes beneath its cache only, so the folders torch writes into while it
runs an engine must be there too, whatever the environment named before the agent started
(torch records its inductor cache in the environment, and child processes inherit it: in a
suite, an agent started after any torch compile in the parent got ``/tmp/torchinductor_*``,
and AOTInductor's loader was refused its lock there)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from runtime_agent.confine import RUNTIME_CACHES, prepare_tmp


def test_torch_caches_named_outside_the_cache_move_beneath_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "elsewhere"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    tmp = prepare_tmp(cache)
    assert tmp.is_relative_to(cache.resolve())
    assert Path(tempfile.gettempdir()) == tmp

    for variable in RUNTIME_CACHES:
        assert Path(os.environ[variable]).is_relative_to(cache.resolve()), variable

def test_a_torch_cache_already_beneath_the_cache_is_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = (tmp_path / "cache").resolve()
    mine = cache / "my-inductor"
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(mine))
    prepare_tmp(cache)

    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(mine)

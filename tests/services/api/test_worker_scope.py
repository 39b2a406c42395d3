"""A worker token scoped to key K acts on K and on K's tuning contexts (``K-t-…``: the same
hardware class, tuned for one node's context), and on nothing else."""

from __future__ import annotations

import pytest

from schemas.errors import Forbidden
from services.api.auth import Principal, Role, check_worker_key

KEY = "ort-cpu-x86-64-v4-ort1.32"


def worker(*keys: str) -> Principal:
    return Principal(subject="w", role=Role.WORKER, jti="j", expires_at=0, keys=list(keys))


@pytest.mark.parametrize("key", [KEY, f"{KEY}-t-c17-64", f"{KEY}-t-c1-4-amxint8-avx512vnni"])
def test_a_key_and_its_tuning_contexts_are_in_scope(key: str) -> None:
    check_worker_key(worker(KEY), key)


@pytest.mark.parametrize("key", [
    "ort-cpu-x86-64-v3-ort1.32", "ort-cpu-x86-64-v3-ort1.32-t-c17-64", f"{KEY}-t-", f"{KEY}x",
    f"{KEY}-tc17-64", KEY[:-1] + "-t-c17-64"])
def test_another_key_or_its_contexts_are_not(key: str) -> None:
    with pytest.raises(Forbidden, match="this worker token builds"):
        check_worker_key(worker(KEY), key)


def test_a_context_key_in_scope_does_not_widen_to_its_base() -> None:
    with pytest.raises(Forbidden):
        check_worker_key(worker(f"{KEY}-t-c17-64"), KEY)

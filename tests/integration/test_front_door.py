"""The API refuses before it reads, measured on a real ``kiln api`` process: an
unauthenticated 200 MB body is answered 401 without the server waiting for it, and the
process's memory does not grow with it.

No timed assertions (``bench/front_door.py`` prints the times): the proof that nothing is
read is that the server answers a client that has sent the headers only.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.front_door import SECRET, ApiProcess, stream

MB = 1024 * 1024


@pytest.fixture(scope="module")
def api_process(tmp_path_factory) -> Iterator[ApiProcess]:
    api = ApiProcess(Path(tmp_path_factory.mktemp("front-door")))
    api.start()
    try:
        yield api
    finally:
        api.stop()


def _admin() -> dict[str, str]:
    from services.api.auth import Role, mint_token

    return {"Authorization": "Bearer " + mint_token(SECRET, role=Role.ADMIN, subject="t",
                                                    ttl_s=600)}


@pytest.mark.parametrize("path", ["/v1/agents", "/v1/models", "/v1/compile-jobs"])
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_no_token_is_answered_without_the_body(api_process, path, chunked):
    answer = stream(api_process.port, path, 200 * MB, chunked=chunked, body=False,
                    timeout_s=20)
    assert answer.status == 401, answer.head
    assert "unauthenticated" in answer.head and answer.sent == 0


def test_an_oversized_body_is_answered_413_without_the_body(api_process):
    answer = stream(api_process.port, "/v1/compile-jobs", 200 * MB, headers=_admin(),
                    body=False, timeout_s=20)
    assert answer.status == 413 and "KILN_MAX_JSON_BYTES" in answer.head


def test_a_streamed_200_mb_body_without_a_token_leaves_memory_flat(api_process):
    before = api_process.rss()
    answers = [stream(api_process.port, path, 200 * MB, chunked=chunked, timeout_s=60)
               for path in ("/v1/agents", "/v1/models") for chunked in (False, True)]
    time.sleep(0.5)
    grown = api_process.rss() - before
    assert [a.status for a in answers] == [401] * 4, [a.head for a in answers]
    # The client stops at the answer; what it had pushed into the socket meanwhile is far
    # from 200 MB, and none of it is kept.
    assert all(a.sent < 200 * MB for a in answers), [a.sent for a in answers]
    assert grown < 20 * MB, f"the API grew by {grown / MB:.1f} MB"
    assert api_process.proc is not None and api_process.proc.poll() is None


def test_an_authenticated_chunked_json_body_is_cut_at_the_limit(api_process):
    answer = stream(api_process.port, "/v1/deployments", 200 * MB, headers=_admin(),
                    chunked=True, timeout_s=60)
    assert answer.status == 413, answer.head
    assert answer.sent < 200 * MB

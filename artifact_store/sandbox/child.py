"""The child's loop: read the request, confine, run one step of the entry point's fixed
table, answer.

A child entry point is a module of the caller's own, run as ``python -m <module>``; its
``__main__`` block hands ``serve_child`` a table of the steps it offers, its functions
imported statically::

    if __name__ == "__main__":
        serve_child({"model": model_child, "dataset": dataset_child})

Nothing is imported by a name the request carries: a step not in the table is refused with
``UnknownStep``. Keep what the entry module imports at its top small (the standard library,
``schemas``): it is imported before the child confines itself; whatever parses or builds the
input is imported inside the step's function, after.

Run as ``python -m <module> --fork-server``, the entry point is its children's fork server
(``artifact_store.sandbox.forkserver``): it imports ``preload`` (the libraries its steps
import, never an input) once, and each child is a fork of it that confines itself and
serves one request as above.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import sys
import traceback
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any, NoReturn

from artifact_store.sandbox.confine import confine
from artifact_store.sandbox.forkserver import FORK_SERVER_FLAG, serve_forks
from artifact_store.sandbox.limits import ALLOCATION_FAILED
from schemas.errors import ErrorBody, ErrorCode, KilnError

__all__ = ["Emit", "Step", "UnknownStep", "serve_child"]

#: How a step reports progress: one JSON object per event.
Emit = Callable[[dict[str, Any]], None]
#: A step: ``function(args, emit) -> JSON value``.
Step = Callable[[dict[str, Any], Emit], Any]


class UnknownStep(KilnError):
    """The request names a step the entry point's table does not hold (the caller's mistake,
    never the input's): refused before anything runs."""

    code = ErrorCode.INTERNAL


def serve_child(steps: Mapping[str, Step],
                preload: Callable[[], None] | None = None) -> NoReturn:
    """The whole life of a sandboxed child: read its request from stdin, confine itself, run
    the requested step of ``steps`` and answer on its answer pipe; then exit. With
    ``--fork-server`` on the command line, be the fork server of such children instead,
    ``preload`` imported first (``forkserver.serve_forks``)."""
    if sys.argv[1:] == [FORK_SERVER_FLAG]:
        serve_forks(lambda: _serve(steps), preload)
    sys.exit(_serve(steps))


def _serve(steps: Mapping[str, Step]) -> int:
    request = json.loads(sys.stdin.buffer.read())
    answer = os.fdopen(request["answer_fd"], "w", buffering=1)

    def send(message: dict[str, Any]) -> None:
        answer.write(json.dumps(message, separators=(",", ":")) + "\n")
        answer.flush()

    report = confine(request)
    send({"sandbox": asdict(report)})
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        name = request.get("step")
        step = steps.get(name) if isinstance(name, str) else None
        if step is None:
            raise UnknownStep(
                f"the sandbox entry point {request.get('entry')!r} has no step {name!r}; its "
                f"steps are: {', '.join(sorted(steps))}", step=str(name), steps=sorted(steps))
        result = step(request["args"], lambda event: send({"event": event}))
        send({"result": result})
    except BaseException as exc:
        traceback.print_exc()
        try:
            body = _classify(exc)
            try:
                send({"error": body.model_dump(mode="json")})
            except (TypeError, ValueError):  # details that are not JSON
                send({"error": {"code": body.code.value, "message": body.message}})
        except MemoryError:
            return 3
    return 0


def _classify(exc: BaseException) -> ErrorBody:
    """The typed error the child reports for ``exc``: an allocation that failed anywhere in
    its chain is ``resource_limit``; a ``KilnError`` is itself; anything else ``internal``."""
    if isinstance(exc, KilnError) and exc.code in (ErrorCode.RESOURCE_LIMIT, ErrorCode.TIMED_OUT):
        return exc.to_body()
    chain: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and seen not in chain:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    if any(isinstance(e, MemoryError) or ALLOCATION_FAILED.search(str(e)) for e in chain):
        return ErrorBody(code=ErrorCode.RESOURCE_LIMIT, message=(
            f"the step ran out of memory under its memory limit: "
            f"{type(exc).__name__}: {str(exc)[:500]}"), details={"limit": "address_space"})
    if isinstance(exc, KilnError):
        return exc.to_body()
    if isinstance(exc, OSError) and exc.errno == errno.EFBIG:
        return ErrorBody(code=ErrorCode.RESOURCE_LIMIT, message=f"a file grew over the "
                         f"file-size limit: {exc}", details={"limit": "file_size"})
    return ErrorBody(code=ErrorCode.INTERNAL,
                     message=f"the sandboxed step failed: {type(exc).__name__}: {exc}")

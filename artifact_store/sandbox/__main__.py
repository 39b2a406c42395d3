"""``python -m artifact_store.sandbox``: a child entry point with one step, ``noop``, that does
nothing: what a sandboxed step costs before its own work (a fresh interpreter and its
confinement), which ``bench/sandbox.py`` times."""

from __future__ import annotations

from typing import Any

from artifact_store.sandbox.child import Emit, serve_child


def noop(args: dict[str, Any], emit: Emit) -> None:
    return None


if __name__ == "__main__":
    serve_child({"noop": noop})

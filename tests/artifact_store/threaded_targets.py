"""A child entry point whose libraries start a thread as they load
(``python -m tests.artifact_store.threaded_targets``): its fork server must refuse to fork."""

from __future__ import annotations

import threading
import time
from typing import Any

from artifact_store.sandbox import serve_child


def _preload() -> None:
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()


def echo(args: dict[str, Any], emit) -> dict[str, Any]:
    return args


if __name__ == "__main__":
    serve_child({"echo": echo}, preload=_preload)

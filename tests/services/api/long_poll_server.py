"""The API of ``test_desired_cache.test_500_held_long_polls_hold_no_thread_each``, in a process
of its own as ``kiln api`` runs it (uvicorn on its main thread).

``python -m tests.services.api.long_poll_server SETTINGS PORT REPORT``: the pickled settings,
the port, and the file where it writes, every tenth of a second, how many long-polls its hub
holds and how many threads the process runs, for the test to read."""

from __future__ import annotations

import json
import pickle
import sys
import threading
import time
from pathlib import Path

import uvicorn

from services.api.app import create_app


def main(settings_file: str, port: str, report_file: str) -> None:
    app = create_app(pickle.loads(Path(settings_file).read_bytes()))
    report = Path(report_file)

    def watch() -> None:
        while True:
            hub = getattr(app.state, "desired_hub", None)
            if hub is not None:
                partial = report.with_suffix(".partial")
                partial.write_text(json.dumps({"held": hub.waiting(),
                                               "threads": threading.active_count()}))
                partial.replace(report)  # the test never reads half a report
            time.sleep(0.1)

    threading.Thread(target=watch, daemon=True).start()
    uvicorn.run(app, host="127.0.0.1", port=int(port), log_level="warning")


if __name__ == "__main__":
    main(*sys.argv[1:])

"""The API's front door on a real ``kiln api`` process (uvicorn, SQLite): how fast a large
body is refused, how much of it the client got to send, and how much the API's memory grew.

Each row streams a body of ``--mb`` megabytes (as fast as loopback takes it) to a route,
and stops when the answer arrives; RSS is the API process's resident memory (psutil) before
the row's requests and after them, with its peak sampled every 5 ms meanwhile.

    .venv/bin/python bench/front_door.py [--mb 200] [--repeats 5]
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

from _common import console, fmt
from rich.table import Table

from services.api.auth import Role, mint_token
from tests.integration.front_door import SECRET, ApiProcess, stream

MB = 1024 * 1024


class PeakRss:
    """Samples the API's RSS every 5 ms while in its ``with`` block."""

    def __init__(self, api: ApiProcess) -> None:
        self.api = api
        self.peak = api.rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.api.rss())
            time.sleep(0.005)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    admin = {"Authorization": "Bearer " + mint_token(SECRET, role=Role.ADMIN, subject="b",
                                                     ttl_s=600)}
    cases = [
        ("no token", "/v1/agents", False, None),
        ("no token", "/v1/agents", True, None),
        ("no token", "/v1/models (upload)", False, None),
        ("no token", "/v1/models (upload)", True, None),
        ("forged token", "/v1/compile-jobs", False,
         {"Authorization": "Bearer " + mint_token("another-secret-" + "x" * 32,
                                                  role=Role.ADMIN, subject="b", ttl_s=600)}),
        ("admin, over KILN_MAX_JSON_BYTES", "/v1/deployments", False, admin),
        ("admin, over KILN_MAX_JSON_BYTES", "/v1/deployments", True, admin),
    ]
    table = Table(title=f"An unwanted {args.mb} MB body against `kiln api` "
                        f"(median \\[min–max] of {args.repeats})")
    for col in ("caller", "route", "framing", "answer", "time to answer", "sent before it",
                "API RSS growth (peak)"):
        table.add_column(col)
    with tempfile.TemporaryDirectory() as home:
        api = ApiProcess(Path(home))
        api.start()
        try:
            for caller, route, chunked, headers in cases:
                path = route.split()[0]
                before = api.rss()
                sampler = PeakRss(api)
                with sampler:
                    answers = [stream(api.port, path, args.mb * MB, headers=headers,
                                      chunked=chunked, timeout_s=120)
                               for _ in range(args.repeats)]
                after, peak = api.rss(), sampler.peak
                table.add_row(
                    caller, route, "chunked" if chunked else "Content-Length",
                    ", ".join(sorted({str(a.status) for a in answers})),
                    fmt([a.seconds for a in answers], 1000, "ms", 2),
                    fmt([a.sent / MB for a in answers], 1, "MB", 1),
                    f"{(after - before) / MB:+.1f} MB ({(peak - before) / MB:+.1f} MB)")
        finally:
            api.stop()
    console.print(table)


if __name__ == "__main__":
    main()

"""SIGTERM answers the held long-polls even when it lands while the event loop holds the
desired-state hub's lock. A signal handler runs in the main thread between two bytecodes; the
handler once closed the hub there, waiting for a lock its own thread held, and the API never
stopped (seen as an API process that outlived its SIGTERM under a loaded host)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

#: Run in a fresh interpreter (its own signal handlers; a deadlock is bounded by the timeout).
SCRIPT = textwrap.dedent("""
    import asyncio, os, signal
    from services.api.app import _answer_long_polls_on_exit
    from services.api.desired import DesiredStateHub

    chained = []
    signal.signal(signal.SIGTERM, lambda sig, frame: chained.append(sig))

    async def main():
        hub = DesiredStateHub()
        restore = _answer_long_polls_on_exit(hub)
        waiter = hub.subscribe("n1")
        with hub._lock:  # the loop holds the hub's lock when the signal lands
            os.kill(os.getpid(), signal.SIGTERM)
            sum(range(100_000))  # bytecodes between which the handler runs
            assert chained == [signal.SIGTERM], chained  # uvicorn's handler ran too
        await asyncio.wait_for(waiter.event.wait(), 10)
        assert hub.closing
        restore()
        assert signal.getsignal(signal.SIGTERM) is not None

    asyncio.run(main())
    print("answered")
""")


def test_sigterm_inside_the_hubs_lock_still_answers_the_long_polls() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "answered"

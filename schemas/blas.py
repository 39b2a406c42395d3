"""numpy's BLAS thread pool in Kiln's own processes: one thread unless the operator says.

numpy's bundled OpenBLAS starts a thread per core when it loads, and those threads spin
before they sleep, at load and again after every product they share. Nothing Kiln runs in
numpy needs the pool (the engines it builds, measures and serves bring their own thread
pools), so the spinning is only cost: start-up CPU paid by every process, each of the
short-lived sandboxed children included, and a core taken from the engine that a worker is
timing or an agent is serving just after a numpy call. ``OPENBLAS_NUM_THREADS`` set by the
operator wins. The children's CPU with and without it: ``bench/sandbox.py``.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

#: The variable OpenBLAS reads when it loads (``OMP_NUM_THREADS`` after it).
VARIABLE = "OPENBLAS_NUM_THREADS"


def one_blas_thread(environ: MutableMapping[str, str] | None = None) -> None:
    """Default ``environ`` (this process's) to one BLAS thread. Effective in this process
    only before numpy is first imported: a process's entry point calls it first."""
    environ = os.environ if environ is None else environ
    environ.setdefault(VARIABLE, "1")

"""Task names and queue names: the whole contract between the API and the workers.

The API enqueues by *name*; it never imports the worker code.
"""

from __future__ import annotations

import re

COMPILE_TASK = "kiln.compile"
QUEUE_PREFIX = "build."

_KEY = re.compile(r"^[A-Za-z0-9_.\-]+$")


def queue_for(fingerprint_key: str) -> str:
    """One queue per hardware class: ``build.<fingerprint key>``."""
    if not _KEY.match(fingerprint_key):
        raise ValueError(f"fingerprint key {fingerprint_key!r} must match {_KEY.pattern}")
    return QUEUE_PREFIX + fingerprint_key

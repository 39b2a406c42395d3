"""The control plane's readiness probes for the API's ``/readyz``: the broker here, the
database with the API (``routers/health.py``), the store its own ``ping``. How probes are
asked and answered is shared with the workers' ``/readyz`` (``schemas.health``)."""

from __future__ import annotations

from schemas.health import READY_TIMEOUT_S, Probe, check, readiness
from schemas.settings import SharedSettings
from services.queue.health import broker_probe as _broker_probe

__all__ = ["READY_TIMEOUT_S", "Probe", "broker_probe", "check", "readiness"]


def broker_probe(settings: SharedSettings) -> Probe:
    return _broker_probe(settings, timeout_s=READY_TIMEOUT_S)

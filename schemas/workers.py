"""Compiler workers as the control plane sees them."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict

from schemas.fingerprint import HardwareFingerprint


class WorkerInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    #: The keys (one per backend) whose queues this worker consumes.
    fingerprint_keys: list[str]
    #: Fingerprint key → the compatibility key a portable engine built there carries
    #: (the control plane queues fallback builds on workers whose keys a node can run).
    portable_keys: dict[str, str] = {}
    fingerprint: HardwareFingerprint
    started_at: datetime
    last_seen: datetime
    #: Heartbeat seen recently and no shutdown recorded.
    alive: bool

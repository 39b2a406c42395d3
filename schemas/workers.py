"""Compiler workers as the control plane sees them."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict

from schemas.fingerprint import HardwareFingerprint

WorkerState = Literal["alive", "stopped", "lost"]


class WorkerInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    #: The process now beating under ``name``: a new id at every start.
    instance: str | None = None
    #: The keys (one per backend) whose queues this worker consumes.
    fingerprint_keys: list[str]
    #: Fingerprint key → the compatibility key a portable engine built there carries
    #: (the control plane queues fallback builds on workers whose keys a node can run).
    portable_keys: dict[str, str] = {}
    #: Fingerprint key → the model formats its backend builds (``onnx``, ``torch-export``):
    #: a compile job for a model of another format is refused for that key.
    model_formats: dict[str, list[str]] = {}
    #: Fingerprint key → the precision policies its backend builds (``fp32``, ``auto``,
    #: ``fp16``, ...): a compile job asking another precision of that key is refused.
    precisions: dict[str, list[str]] = {}
    fingerprint: HardwareFingerprint
    started_at: datetime
    last_seen: datetime
    #: Heartbeat seen recently and no shutdown recorded.
    alive: bool
    #: ``alive``; ``stopped`` (it said so when it shut down); ``lost`` (its heartbeats
    #: stopped). Lost and stopped workers are pruned after ``KILN_WORKER_PRUNE_S``.
    state: WorkerState = "alive"
    #: Its heartbeat interval, seconds.
    heartbeat_s: float | None = None

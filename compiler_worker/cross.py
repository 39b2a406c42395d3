"""A cross-compiling worker's declared targets (``KILN_WORKER_CROSS_TARGETS``): the nodes of
another architecture it builds engines for, without their hardware.

Each entry is an architecture name (``aarch64``: a plain Armv8-A node, NEON only, with this
worker's runtime versions, since an engine must be built by the release the node runs) or a
fingerprint file (JSON of ``HardwareFingerprint``) declaring one node exactly. For every
target, each registered backend that cross-compiles (``Backend.cross_compiles``) and supports
it gives one fingerprint key: the worker consumes its queue and advertises it in its
heartbeat, so the planner routes that node's builds here. Such an engine is built, never run
on the worker: its verification and benchmark are deferred to the node
(``cross_build.runs_here``), whose golden check on activation decides.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from compiler_worker.backends import available
from compiler_worker.backends.base import PIPELINE_MODEL_FORMATS, Backend
from schemas.errors import ConfigError
from schemas.fingerprint import CpuInfo, HardwareFingerprint

#: The architectures an entry may name, with the baseline features such a node has.
ARCHITECTURES = {"aarch64": ["neon"]}


def target_fingerprint(entry: str, host: HardwareFingerprint) -> HardwareFingerprint:
    """The node an entry of ``KILN_WORKER_CROSS_TARGETS`` declares (``ConfigError`` naming
    what is accepted otherwise)."""
    name = entry.strip()
    if name.lower() in ARCHITECTURES:
        return HardwareFingerprint(
            os=host.os, cpu=CpuInfo(arch=name.lower(), features=ARCHITECTURES[name.lower()]),
            runtimes=dict(host.runtimes), source="declared")
    path = Path(name)
    if not path.is_file():
        raise ConfigError(
            f"KILN_WORKER_CROSS_TARGETS: {entry!r} is neither an architecture "
            f"({sorted(ARCHITECTURES)}) nor a fingerprint file", entry=entry)
    try:
        declared = HardwareFingerprint.model_validate_json(path.read_text())
    except (ValidationError, ValueError) as exc:
        raise ConfigError(f"KILN_WORKER_CROSS_TARGETS: {path} is not a fingerprint (JSON of "
                          f"HardwareFingerprint): {exc}", entry=entry) from exc
    return declared.model_copy(update={"source": "declared"})


def cross_backends(target: HardwareFingerprint) -> list[Backend]:
    """The registered backends that cross-compile for ``target`` through the pipeline."""
    return [b for b in available()
            if b.cross_compiles and b.supports(target)
            and b.model_formats & PIPELINE_MODEL_FORMATS]


def cross_targets(entries: Sequence[str], host: HardwareFingerprint
                  ) -> dict[str, HardwareFingerprint]:
    """Fingerprint key → the declared node it builds for, over every entry and every backend
    that cross-compiles for it. A target of the host's own architecture is refused (the worker
    builds for itself already), and so is one no backend here cross-compiles for."""
    found: dict[str, HardwareFingerprint] = {}
    for entry in entries:
        target = target_fingerprint(entry, host)
        if target.cpu.arch == host.cpu.arch:
            raise ConfigError(
                f"KILN_WORKER_CROSS_TARGETS: {entry!r} is a {target.cpu.arch} node, this "
                f"worker's own architecture; a cross target is another one", entry=entry)
        backends = cross_backends(target)
        if not backends:
            cross = sorted(b.name for b in available() if b.cross_compiles)
            raise ConfigError(
                f"KILN_WORKER_CROSS_TARGETS: no backend here cross-compiles for {entry!r} "
                f"({target.cpu.arch}); backends that cross-compile: {cross or 'none'} (each "
                f"needs its runtime version in the target's fingerprint)", entry=entry)
        for backend in backends:
            found[backend.fingerprint_key(target)] = target
    return found

"""Latency of one runner on one fixed feed (wall clock, ``time.perf_counter``), and the
host's share of it: a host-wide lock so that one benchmark runs at a time, and samples of how
busy the host's CPUs were (``/proc/stat``, ``/proc/loadavg``)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from schemas.errors import InvalidOptions
from schemas.manifest import BenchmarkResult

logger = logging.getLogger(__name__)

Runner = Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]]


def benchmark(
    run: Runner, inputs: Mapping[str, np.ndarray], *, iterations: int, warmup: int
) -> BenchmarkResult:
    """Call ``run(inputs)`` ``warmup`` times untimed, then ``iterations`` times timed.

    Reports p50/p90/mean/min in milliseconds and the input shapes. The numbers describe the
    build host under whatever else it was doing; they are for comparison, not a promise.
    """
    if iterations < 1 or warmup < 0:
        raise InvalidOptions(
            f"benchmark needs iterations >= 1 and warmup >= 0; got {iterations} and {warmup}"
        )
    for _ in range(warmup):
        run(inputs)
    timings = np.empty(iterations, dtype=np.float64)
    for i in range(iterations):
        start = time.perf_counter()
        run(inputs)
        timings[i] = (time.perf_counter() - start) * 1000.0
    return BenchmarkResult(
        iterations=iterations,
        warmup=warmup,
        p50_ms=float(np.percentile(timings, 50)),
        p90_ms=float(np.percentile(timings, 90)),
        mean_ms=float(timings.mean()),
        min_ms=float(timings.min()),
        input_shapes={name: [int(d) for d in np.shape(value)] for name, value in inputs.items()},
    )


# --- the host's share: one benchmark at a time, and what else ran ---------------------------

#: Seconds between one engine's timed calls and the next engine's, wherever several are timed
#: in one process (the tuner's rounds, the benchmarks' blocks). The runtimes' worker threads
#: spin-wait a while after a call (onnxruntime's by default); an engine timed inside that
#: window shares the cores with them, so a small model's figures would follow the order the
#: engines ran in (``bench/spin_gap.py`` shows it with identical sessions).
SPIN_GAP_S = 0.05

#: Where every Kiln process on a host takes its turn to time engines (``KILN_BENCHMARK_LOCK``
#: overrides it). ``/dev/shm`` is the host's own memory-backed folder: a sandboxed build's
#: ``/tmp`` is private to it, and Landlock lets it read ``/dev``, where it opens the lock file.
DEFAULT_LOCK_DIR = Path("/dev/shm")
LOCK_FILENAME = "kiln-benchmark.lock"


def default_lock_path() -> Path:
    """``/dev/shm/kiln-benchmark.lock``, or the system's temporary folder where there is no
    ``/dev/shm``."""
    folder = DEFAULT_LOCK_DIR if DEFAULT_LOCK_DIR.is_dir() else Path(tempfile.gettempdir())
    return folder / LOCK_FILENAME


def ensure_lock_file(path: Path | None = None) -> Path:
    """Create the lock file (readable by every user, so workers of other users share it) and
    return its path. A sandboxed child may only read outside its folder: the worker that
    starts it creates the file first."""
    path = Path(path) if path is not None else default_lock_path()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            os.fchmod(fd, 0o666)
        except OSError:  # another user's file: its mode is theirs
            pass
        finally:
            os.close(fd)
    return path


@dataclass
class HostLock:
    """A held (or, past the wait, not held) host-wide benchmark lock."""

    path: Path
    held: bool
    waited_s: float
    why: str = ""


@contextlib.contextmanager
def host_lock(path: Path | None = None, *, wait_s: float = 600.0,
              poll_s: float = 0.05) -> Iterator[HostLock]:
    """Hold the host's benchmark lock (``fcntl.flock`` on ``path``) for the ``with`` block:
    every worker process and ``kiln agent --build`` on the host times engines one at a time,
    so no measurement runs beside another's. Waits up to ``wait_s``; past it (or where the
    file cannot be opened) the block runs without the lock, and ``HostLock.held`` says so with
    the reason: a stuck neighbour must not hang a job."""
    path = Path(path) if path is not None else default_lock_path()
    started = time.monotonic()
    fd: int | None = None
    for flags in (os.O_RDWR | os.O_CREAT, os.O_RDONLY):  # a sandboxed child may only read
        try:
            fd = os.open(path, flags | os.O_CLOEXEC, 0o666)
            break
        except OSError as exc:
            why = f"cannot open {path}: {exc.strerror}"
    if fd is None:
        logger.warning("benchmark lock: %s; timing without it", why)
        yield HostLock(path, held=False, waited_s=0.0, why=why)
        return
    try:
        held, logged = False, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
                break
            except BlockingIOError:
                waited = time.monotonic() - started
                if waited >= wait_s:
                    break
                if not logged:
                    logger.info("benchmark lock %s is held by another benchmark; waiting", path)
                    logged = True
                time.sleep(poll_s)
        waited = time.monotonic() - started
        why = "" if held else f"another benchmark held {path} for {waited:.0f} s"
        if not held:
            logger.warning("benchmark lock: %s; timing without it", why)
        yield HostLock(path, held=held, waited_s=waited, why=why)
    finally:
        os.close(fd)  # closing the descriptor releases the lock


@dataclass(frozen=True)
class CpuTimes:
    """Cumulative CPU time of the host (``/proc/stat``) and of this process, in ticks."""

    total: int
    busy: int
    steal: int
    own: int
    at: float


def read_cpu_times() -> CpuTimes | None:
    """The host's and this process's CPU ticks now (``None`` where ``/proc`` cannot be read)."""
    try:
        with open("/proc/stat") as handle:
            fields = handle.readline().split()
        with open("/proc/self/stat") as handle:
            own_fields = handle.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    values = [int(v) for v in fields[1:]]
    values += [0] * (8 - len(values))
    user, nice, system, idle, iowait, irq, softirq, steal = values[:8]
    # guest time is already counted in user and nice; idle and iowait are not busy.
    total = user + nice + system + idle + iowait + irq + softirq + steal
    busy = user + nice + system + irq + softirq
    own = int(own_fields[11]) + int(own_fields[12])  # utime, stime (every thread)
    return CpuTimes(total=total, busy=busy, steal=steal, own=own, at=time.monotonic())


def loadavg() -> float:
    """The host's 1-minute load average (0 where ``/proc/loadavg`` cannot be read)."""
    try:
        with open("/proc/loadavg") as handle:
            return float(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0


@dataclass(frozen=True)
class CpuShare:
    """The host's CPU over a window: shares of its whole capacity (all CPUs)."""

    seconds: float
    #: Spent by other processes (this one's own time subtracted).
    busy: float
    steal: float
    loadavg: float


class CpuSampler:
    """Samples the host's CPU between ``start`` and ``stop``: how busy other processes kept it
    and how much the hypervisor stole, as shares of its capacity."""

    def __init__(self) -> None:
        self._start: CpuTimes | None = None

    def start(self) -> None:
        self._start = read_cpu_times()

    def stop(self) -> CpuShare:
        end, start = read_cpu_times(), self._start
        if end is None or start is None or end.total <= start.total:
            return CpuShare(seconds=0.0 if start is None or end is None else end.at - start.at,
                            busy=0.0, steal=0.0, loadavg=loadavg())
        total = end.total - start.total
        others = max(0, (end.busy - start.busy) - (end.own - start.own))
        return CpuShare(seconds=end.at - start.at, busy=min(1.0, others / total),
                        steal=min(1.0, (end.steal - start.steal) / total), loadavg=loadavg())


def sample_host(seconds: float) -> CpuShare:
    """The host's CPU over the next ``seconds`` while this process sleeps."""
    sampler = CpuSampler()
    sampler.start()
    time.sleep(seconds)
    return sampler.stop()

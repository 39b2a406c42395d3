"""A fleet against ``kiln api`` on PostgreSQL (Redis as the broker, a local store), served by
``--api-processes`` processes (default 2: one per core of a 2-core machine) and
``--agent-processes`` more (default 1; 0: none) on a port of their own that the agents use
(``KILN_API_AGENT_PORT``):
N simulated agents (default 10,000) that each hold a long-poll of their desired state and send a
liveness heartbeat (``Prefer: return=minimal``) every 30 s, spread evenly, while clients submit
an already built model (answered from the cache) at a steady rate (default 200/s).

The agents exist as rows (written straight to the database: registration is not what is
measured) on one hardware key, labelled ``g=0..99`` and ``ring=0..9``. Ten deployments select
``g=0..9``; one, ``wide``, selects ``ring=3`` (a tenth of the fleet). Phases:

0. one request of each kind at a time on the idle API: its latency and CPU per request;
1. ramp: every agent fetches its desired state once and holds its long-poll;
2. ``heartbeats``: heartbeats and held long-polls only;
3. ``+ submissions``: the same plus the submissions; halfway through, ``wide`` is pointed at
   another model and the time until every long-poll it concerns is answered is taken.

The load generator (aiohttp on one uvloop event loop) runs in this process, the API in its
own; on a small machine they share its cores, which the tables say (CPU of each), and its own
event loop's lag (how late a 10 ms sleep wakes): every latency it takes includes that lag.
Database time is PostgreSQL's own account of it (``pg_stat_database.active_time``, all
statements of the API's database in the phase), divided by the heartbeats of the phase: an
upper bound of a heartbeat's share, since long-poll renewals and submissions are in it too.

    .venv/bin/python bench/scale.py [--agents 10000] [--submit-rate 200] [--phase-s 30]
                                    [--api-processes 2] [--agent-processes 1] [--api-nice 5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import resource
import signal
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil
import redis
import sqlalchemy as sa
import uvloop
from _common import console, free_port
from rich.table import Table

from artifact_store.registry import open_store
from artifact_store.signing import load_signer
from kiln.stack import EmbeddedStack
from services.db import make_engine, make_session_factory, repo, session_scope
from services.db.tables import AgentRow, utcnow
from tests.services.api.conftest import registration
from tests.services.db.helpers import add_model, manifest

KEY = "ort-cpu-x86-64-v3-ort1.32"
PG_ADMIN = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
REDIS = os.environ.get("KILN_BENCH_REDIS_URL", "redis://127.0.0.1:6379/14")
HEARTBEAT_S = 30.0
WAIT_S = 50.0
#: Heartbeats sent this long after the deployment change are reported apart.
CHANGE_WINDOW_S = 5.0


@dataclass
class Phase:
    name: str
    started: float = 0.0
    ended: float = 0.0
    heartbeats: list[float] = field(default_factory=list)
    #: When each of ``heartbeats`` was sent (``time.perf_counter()``).
    heartbeat_at: list[float] = field(default_factory=list)
    submissions: list[float] = field(default_factory=list)
    renewals: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    api_cpu_s: float = 0.0
    own_cpu_s: float = 0.0
    pg_cpu_s: float = 0.0
    #: The machine's busy share over the phase (all processes), 0..1.
    busy: float = 0.0
    api_rss: list[int] = field(default_factory=list)
    #: How late the load generator's event loop woke a 10 ms sleep, seconds, sampled over the
    #: phase: every latency it takes includes its own lateness.
    loop_lag: list[float] = field(default_factory=list)
    db_active_ms: float = 0.0
    db_xacts: int = 0

    @property
    def seconds(self) -> float:
        return self.ended - self.started


class Fleet:
    def __init__(self, url: str, token: str, names: list[str], *,
                 submit_url: str | None = None) -> None:
        self.url, self.names = url, names
        #: Where clients submit (the API's port; ``url`` is the agents' own, when it has one).
        self.submit_url = submit_url or url
        self.headers = {"Authorization": f"Bearer {token}"}
        self.digests: dict[str, str] = {}
        self.phase: Phase | None = None
        #: (agent index, seconds since the change) of each 200 after ``changed_at``.
        self.answered: list[tuple[int, float]] = []
        self.changed_at: float | None = None
        self.stop = False
        self.submitting = False
        self.held = 0
        #: Agents whose first held long-poll (of a random length) has been answered.
        self.renewed: dict[str, bool] = {}

    def _error(self, what: str) -> None:
        if self.phase is not None:
            self.phase.errors[what] = self.phase.errors.get(what, 0) + 1

    async def long_poll(self, http: aiohttp.ClientSession, i: int) -> None:
        name = self.names[i]
        # A fleet in its steady state renews its long-polls at even intervals; agents that all
        # came up within the ramp would renew in waves. The first held long-poll of each
        # lasts a random share of WAIT_S, so the renewals are spread from the start.
        first_wait = random.Random(i).uniform(1.0, WAIT_S)
        while not self.stop:
            wait = WAIT_S if self.renewed.get(name) else first_wait
            params = {"wait": f"{wait:.3f}"} | (
                {"after": self.digests[name]} if name in self.digests else {})
            try:
                self.held += 1
                async with http.get(f"{self.url}/v1/agents/{name}/desired-state",
                                    params=params, headers=self.headers) as r:
                    await r.read()
                    status, etag = r.status, r.headers.get("ETag", "").strip('"')
            except (aiohttp.ClientError, TimeoutError) as exc:
                self._error(f"long-poll {type(exc).__name__}")
                await asyncio.sleep(1.0)
                continue
            finally:
                self.held -= 1
            if name in self.digests:
                self.renewed[name] = True
            if status == 200:
                first = name not in self.digests
                self.digests[name] = etag
                if not first and self.changed_at is not None:
                    self.answered.append((i, time.perf_counter() - self.changed_at))
            elif status == 204:
                if self.phase is not None:
                    self.phase.renewals += 1
            else:
                self._error(f"long-poll {status}")
                await asyncio.sleep(1.0)

    async def heartbeats(self, http: aiohttp.ClientSession, i: int, offset: float) -> None:
        name = self.names[i]
        await asyncio.sleep(offset)
        body = json.dumps({"models": []})
        headers = {**self.headers, "Prefer": "return=minimal",
                   "Content-Type": "application/json"}
        while not self.stop:
            due = time.perf_counter() + HEARTBEAT_S
            started = time.perf_counter()
            try:
                async with http.post(f"{self.url}/v1/agents/{name}/heartbeat", data=body,
                                     headers=headers) as r:
                    await r.read()
                    ok = r.status == 204
            except (aiohttp.ClientError, TimeoutError) as exc:
                self._error(f"heartbeat {type(exc).__name__}")
                ok = False
            if self.phase is not None:
                if ok:
                    self.phase.heartbeats.append(time.perf_counter() - started)
                    self.phase.heartbeat_at.append(started)
                else:
                    self._error("heartbeat not 204")
            await asyncio.sleep(max(0.0, due - time.perf_counter()))

    async def loop_lag(self, period: float = 0.01) -> None:
        """Sample this load generator's own event-loop lag into the current phase: a loop busy
        with its 10,000 agents' callbacks wakes a sleep late, and every request it times waits
        the same. When it is near the heartbeat's latency, the table measures the generator,
        not the API."""
        while not self.stop:
            started = time.perf_counter()
            await asyncio.sleep(period)
            if self.phase is not None:
                self.phase.loop_lag.append(time.perf_counter() - started - period)

    async def submissions(self, http: aiohttp.ClientSession, model_id: str,
                          rate: float) -> None:
        body = json.dumps({"model_id": model_id, "targets": [{"fingerprint_key": KEY}]})
        headers = {**self.headers, "Content-Type": "application/json"}
        tasks: set[asyncio.Task] = set()

        async def one() -> None:
            started = time.perf_counter()
            try:
                async with http.post(f"{self.submit_url}/v1/compile-jobs", data=body,
                                     headers=headers) as r:
                    answer = await r.json()
                    cached = r.status == 202 and all(
                        j["status"] == "succeeded" for j in answer["jobs"])
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:
                self._error(f"submission {type(exc).__name__}")
                return
            if self.phase is not None:
                if cached:
                    self.phase.submissions.append(time.perf_counter() - started)
                else:
                    if not any(k.startswith("submission") for k in self.phase.errors):
                        console.print(f"a submission was no cache hit: {r.status} {answer}",
                                      markup=False)
                    self._error(f"submission {r.status} not a cache hit")

        next_at = time.perf_counter()
        while self.submitting:
            task = asyncio.create_task(one())
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            next_at += 1 / rate
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        await asyncio.gather(*tasks, return_exceptions=True)


class ApiProcesses:
    """``kiln api`` and the processes it serves with: CPU and memory summed over them."""

    def __init__(self, parent: psutil.Process) -> None:
        self.parent = parent
        self._seen: dict[int, psutil.Process] = {}

    def all(self) -> list[psutil.Process]:
        for child in self.parent.children(recursive=True):
            self._seen.setdefault(child.pid, child)
        return [self.parent, *self._seen.values()]

    def cpu(self) -> float:
        """User + system seconds of them all."""
        total = 0.0
        for process in self.all():
            with contextlib.suppress(psutil.NoSuchProcess):
                total += sum(process.cpu_times()[:2])
        return total

    def rss(self) -> int:
        total = 0
        for process in self.all():
            with contextlib.suppress(psutil.NoSuchProcess):
                total += process.memory_info().rss
        return total


async def one_at_a_time(http: aiohttp.ClientSession, fleet: Fleet, api: ApiProcesses,
                        model_id: str, n: int) -> list[tuple[str, list[float], float]]:
    """Each kind of request ``n`` times, one at a time, on the idle API: (what, seconds per
    request, API CPU seconds per request). Where a request's cost goes before any load."""
    name = fleet.names[0]
    async with http.get(f"{fleet.url}/v1/agents/{name}/desired-state",
                        headers=fleet.headers) as r:
        digest = r.headers["ETag"].strip('"')
    json_headers = {**fleet.headers, "Content-Type": "application/json"}
    kinds = {
        "GET /healthz (no token, no database)": ("GET", "/healthz", None, {}),
        "heartbeat, Prefer: return=minimal": (
            "POST", f"/v1/agents/{name}/heartbeat", json.dumps({"models": []}),
            {**json_headers, "Prefer": "return=minimal"}),
        "long-poll renewal, nothing changed (wait=0)": (
            "GET", f"/v1/agents/{name}/desired-state?after={digest}&wait=0", None,
            fleet.headers),
        "cached submission": (
            "POST", "/v1/compile-jobs",
            json.dumps({"model_id": model_id, "targets": [{"fingerprint_key": KEY}]}),
            json_headers),
    }
    rows = []
    for what, (method, path, body, headers) in kinds.items():
        samples = []
        cpu0 = api.cpu()
        for _ in range(n):
            started = time.perf_counter()
            base = fleet.submit_url if path == "/v1/compile-jobs" else fleet.url
            async with http.request(method, base + path, data=body,
                                    headers=headers) as r:
                await r.read()
                if r.status >= 300 and r.status != 204:
                    raise RuntimeError(f"{what}: {r.status} {await r.text()}")
            samples.append(time.perf_counter() - started)
        rows.append((what, samples, (api.cpu() - cpu0) / n))
    return rows


def seed(database_url: str, store_uri: str, signing_key: Path, agents: int) -> list[str]:
    """Agents as rows; two models with an engine each for KEY. Returns the model ids."""
    body = registration("seed", KEY)
    now = utcnow()
    sessions = make_session_factory(make_engine(database_url))
    with session_scope(sessions) as session:
        session.execute(sa.insert(AgentRow), [{
            "name": f"agent-{i:05d}", "labels": {"g": str(i % 100), "ring": str(i % 10)},
            "fingerprint": body["fingerprint"], "fingerprint_keys": body["fingerprint_keys"],
            "compatibility_keys": body["compatibility_keys"], "serve_url": None, "models": [],
            "registered_at": now, "last_seen": now, "trust": None} for i in range(agents)])
    store, signer = open_store(store_uri), load_signer(signing_key)
    model_ids = []
    for seed_name in ("scale-a", "scale-b"):
        with session_scope(sessions) as session:
            model = add_model(session, seed_name)
        built = manifest(model.id, fingerprint_key=KEY)
        blobs = [store.put_blob_bytes(os.urandom(ref.size), name=ref.name) for ref in built.blobs]
        signed = store.publish_manifest(built.model_copy(update={"blobs": blobs}), signer)
        with session_scope(sessions) as session:
            repo.record_artifact(session, model_id=model.id, manifest=signed)
        model_ids.append(model.id)
    return model_ids


class PostgresCpu:
    """User + system seconds the PostgreSQL server processes of this machine spent since
    ``start``, sampled (``sample``) every second: a backend that exits between two samples
    keeps what the last one saw; one that started meanwhile counts from zero."""

    def __init__(self) -> None:
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.started = False

    def sample(self) -> None:
        for process in psutil.process_iter(["name"]):
            if process.info["name"] not in ("postgres", "postmaster"):
                continue
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                cpu = sum(process.cpu_times()[:2])
                self.first.setdefault(process.pid, cpu if not self.started else 0.0)
                self.last[process.pid] = cpu
        self.started = True

    def seconds(self) -> float:
        return sum(self.last[pid] - self.first[pid] for pid in self.last)


def pg_activity(admin: sa.Engine, db: str) -> tuple[float, int]:
    with admin.connect() as conn:
        conn.execute(sa.text("SELECT pg_stat_clear_snapshot()"))
        row = conn.execute(sa.text(
            "SELECT active_time, xact_commit + xact_rollback FROM pg_stat_database "
            "WHERE datname = :db"), {"db": db}).one()
    return float(row[0]), int(row[1])


async def run(args, stack: EmbeddedStack, admin: sa.Engine, db: str,
              model_ids: list[str]) -> tuple[list[Phase], Fleet, float, list]:
    names = [f"agent-{i:05d}" for i in range(args.agents)]
    agent_port = stack.overrides.get("KILN_API_AGENT_PORT")
    fleet = Fleet(f"http://{stack.host}:{agent_port}" if agent_port else stack.api_url,
                  stack.token or "", names, submit_url=stack.api_url)
    api = ApiProcesses(psutil.Process(stack.processes[0].pid))
    me = psutil.Process()
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=WAIT_S + 60)
    # Heartbeats and submissions share a bounded pool of connections: unbounded, each one that
    # found every connection busy would open another and keep it alive, and one process would
    # run out of file descriptors (10,000 held long-polls plus as many idle connections).
    short = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=500), timeout=timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http, short:
        async def deploy(name: str, model_id: str, selector: dict[str, str]) -> float:
            started = time.perf_counter()
            async with http.post(f"{stack.api_url}/v1/deployments", headers=fleet.headers,
                                 json={"name": name, "model_id": model_id,
                                       "selector": selector}) as r:
                r.raise_for_status()
                await r.read()
            return time.perf_counter() - started

        for d in range(10):
            await deploy(f"g{d}", model_ids[0], {"g": str(d)})
        await deploy("wide", model_ids[0], {"ring": "3"})

        costs = await one_at_a_time(http, fleet, api, model_ids[0], args.cost_requests)

        # Ramp: the first fetch of each agent's state, at most ``ramp_rate`` a second.
        ramp = time.perf_counter()
        tasks = []
        for i in range(args.agents):
            tasks.append(asyncio.create_task(fleet.long_poll(http, i)))
            if i % 50 == 49:
                await asyncio.sleep(50 / args.ramp_rate)
        while len(fleet.digests) < args.agents:
            await asyncio.sleep(0.2)
        console.print(f"{args.agents} agents hold long-polls "
                      f"({time.perf_counter() - ramp:.0f} s after the first)")
        tasks += [asyncio.create_task(fleet.heartbeats(short, i, HEARTBEAT_S * i / args.agents))
                  for i in range(args.agents)]
        tasks.append(asyncio.create_task(fleet.loop_lag()))
        await asyncio.sleep(2.0)

        phases = []
        for name, submit in (("heartbeats", False), ("+ submissions", True)):
            phase = Phase(name)
            fleet.phase = phase
            fleet.submitting = submit
            submitter = (asyncio.create_task(fleet.submissions(short, model_ids[0],
                                                               args.submit_rate))
                         if submit else None)
            active0, xacts0 = pg_activity(admin, db)
            api_cpu0, own_cpu0 = api.cpu(), sum(me.cpu_times()[:2])
            postgres = PostgresCpu()
            postgres.sample()
            psutil.cpu_percent()  # the machine's busy share counts from here
            phase.started = time.perf_counter()
            change_s = None
            while time.perf_counter() - phase.started < args.phase_s:
                await asyncio.sleep(1.0)
                phase.api_rss.append(api.rss())
                postgres.sample()
                if submit and change_s is None and (
                        time.perf_counter() - phase.started >= args.phase_s / 2):
                    fleet.changed_at = time.perf_counter()
                    change_s = await deploy("wide", model_ids[1], {"ring": "3"})
            phase.ended = time.perf_counter()
            console.print(f"phase {name}: {len(phase.heartbeats)} heartbeats, "
                          f"{len(phase.submissions)} submissions, errors {phase.errors}")
            phase.api_cpu_s = api.cpu() - api_cpu0
            phase.own_cpu_s = sum(me.cpu_times()[:2]) - own_cpu0
            postgres.sample()
            phase.pg_cpu_s = postgres.seconds()
            phase.busy = psutil.cpu_percent() / 100
            if submitter is not None:
                fleet.submitting = False
                await submitter
            await asyncio.sleep(1.5)  # PostgreSQL's statistics catch up
            active1, xacts1 = pg_activity(admin, db)
            phase.db_active_ms, phase.db_xacts = active1 - active0, xacts1 - xacts0
            phases.append(phase)
        fleet.phase = None
        fleet.stop = True
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return phases, fleet, change_s or 0.0, costs


def pct(samples: list[float], q: float) -> float:
    return statistics.quantiles(samples, n=1000)[int(q * 1000) - 1] if len(samples) > 1 else (
        samples[0] if samples else float("nan"))


def report(args, phases: list[Phase], fleet: Fleet, change_s: float, costs: list) -> None:
    cores = os.cpu_count()
    table = Table(title=f"One request at a time on the idle API ({args.cost_requests} each; "
                        f"CPU: the API processes' user + system time per request)")
    for col in ("request", "p50 ms", "p99 ms", "spread (max/min)", "API CPU ms / request",
                "vs /healthz"):
        table.add_column(col, justify="right")
    base = costs[0][2]
    for what, samples, cpu in costs:
        table.add_row(what, f"{pct(samples, 0.5) * 1000:.2f}", f"{pct(samples, 0.99) * 1000:.2f}",
                      f"{max(samples) / min(samples):.1f}x", f"{cpu * 1000:.2f}",
                      f"{cpu / base:.1f}x" if base else "-")
    console.print(table)

    fleet_port = (f" + {args.agent_processes} on the agents' own port (the API's at nice "
                  f"+{args.api_nice})" if args.agent_processes else "")
    table = Table(title=f"{args.agents} agents on `kiln api` with {args.api_processes} "
                        f"process(es){fleet_port} (PostgreSQL, Redis), "
                        f"heartbeats every {HEARTBEAT_S:g} s, long-polls of {WAIT_S:g} s; "
                        f"{cores} cores shared by the API, PostgreSQL and this load generator")
    for col in ("phase", "s", "requests", "rate /s", "p50 ms", "p99 ms", "max ms",
                "p99/p50", "errors"):
        table.add_column(col, justify="right")
    for phase in phases:
        for what, samples, target in (("heartbeat", phase.heartbeats, args.agents / HEARTBEAT_S),
                                      ("submission", phase.submissions, args.submit_rate)):
            if not samples and what == "submission":
                continue
            p50, p99 = pct(samples, 0.5) * 1000, pct(samples, 0.99) * 1000
            table.add_row(f"{phase.name}: {what}", f"{phase.seconds:.0f}", str(len(samples)),
                          f"{len(samples) / phase.seconds:.0f} of {target:.0f}",
                          f"{p50:.1f}", f"{p99:.1f}", f"{max(samples) * 1000:.0f}",
                          f"{p99 / p50:.1f}x",
                          ", ".join(f"{k}: {v}" for k, v in phase.errors.items()) or "0")
        if fleet.changed_at is not None and phase.started <= fleet.changed_at <= phase.ended:
            # Where the phase's p99 comes from: the heartbeats sent while the deployment's
            # thousand long-polls were being answered, and the others.
            window = (fleet.changed_at, fleet.changed_at + CHANGE_WINDOW_S)
            split = {True: [], False: []}
            for at, latency in zip(phase.heartbeat_at, phase.heartbeats, strict=True):
                split[window[0] <= at < window[1]].append(latency)
            for inside, samples in split.items():
                if len(samples) < 2:
                    continue
                p50, p99 = pct(samples, 0.5) * 1000, pct(samples, 0.99) * 1000
                span = CHANGE_WINDOW_S if inside else phase.seconds - CHANGE_WINDOW_S
                table.add_row(f"  heartbeats {'within' if inside else 'outside'} "
                              f"{CHANGE_WINDOW_S:g} s of the change", f"{span:.0f}",
                              str(len(samples)), f"{len(samples) / span:.0f}", f"{p50:.1f}",
                              f"{p99:.1f}", f"{max(samples) * 1000:.0f}", f"{p99 / p50:.1f}x",
                              "")
    console.print(table)

    table = Table(title="Cost: the API processes, PostgreSQL, and the load generator beside them")
    for col in ("phase", "API CPU % (100 = a core; all processes)", "API RSS MiB (median [max])",
                "long-poll renewals /s", "DB active ms / heartbeat (all statements)",
                "DB transactions / heartbeat", "PostgreSQL CPU %", "load generator CPU %",
                "load generator loop lag p50 / p99 ms", "machine busy %"):
        table.add_column(col, justify="right")
    for phase in phases:
        beats = max(1, len(phase.heartbeats))
        rss = [r / 2**20 for r in phase.api_rss]
        table.add_row(phase.name, f"{100 * phase.api_cpu_s / phase.seconds:.0f}",
                      f"{statistics.median(rss):.0f} [{max(rss):.0f}]",
                      f"{phase.renewals / phase.seconds:.0f}",
                      f"{phase.db_active_ms / beats:.3f}", f"{phase.db_xacts / beats:.2f}",
                      f"{100 * phase.pg_cpu_s / phase.seconds:.0f}",
                      f"{100 * phase.own_cpu_s / phase.seconds:.0f}",
                      f"{1000 * pct(phase.loop_lag, 0.5):.1f} / "
                      f"{1000 * pct(phase.loop_lag, 0.99):.1f}",
                      f"{100 * phase.busy:.0f} of {os.cpu_count()} cores")
    console.print(table)

    selected = sum(1 for i in range(args.agents) if i % 10 == 3)
    times = sorted(t for _, t in fleet.answered)
    wrong = sum(1 for i, _ in fleet.answered if i % 10 != 3)
    table = Table(title="Deployment `wide` (ring=3) pointed at another model during the "
                        "submissions: its held long-polls answered")
    for col in ("agents selected", "answered 200", "others answered", "POST answered ms",
                "first ms", "p50 ms", "p99 ms", "all answered ms"):
        table.add_column(col, justify="right")
    table.add_row(str(selected), str(len(times)), str(wrong), f"{change_s * 1000:.0f}",
                  *(f"{v * 1000:.0f}" for v in (
                      (times[0], pct(times, 0.5), pct(times, 0.99), times[-1]) if times
                      else (float("nan"),) * 4)))
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=10_000)
    parser.add_argument("--api-processes", type=int, default=2,
                        help="processes `kiln api` serves with (KILN_API_PROCESSES)")
    parser.add_argument("--agent-processes", type=int, default=1,
                        help="processes serving a port of the agents' own "
                        "(KILN_API_AGENT_PROCESSES; 0: the agents use the API's port)")
    parser.add_argument("--api-nice", type=int, default=5,
                        help="niceness of the API port's processes against the fleet port's "
                        "(KILN_API_NICE, whose default is 5; 0: the same priority)")
    parser.add_argument("--submit-rate", type=float, default=200.0)
    parser.add_argument("--phase-s", type=float, default=30.0)
    parser.add_argument("--cost-requests", type=int, default=300,
                        help="requests of each kind for the one-at-a-time table")
    parser.add_argument("--ramp-rate", type=float, default=1000.0,
                        help="first fetches a second while the agents come up")
    args = parser.parse_args()
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = args.agents + 2000  # each process: a socket per held long-poll, and spare
    if hard != resource.RLIM_INFINITY and hard < need:
        raise SystemExit(f"{args.agents} agents need about {need} open files; the hard limit "
                         f"is {hard} (raise it, or ask for fewer agents)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the API inherits it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the API and drop the db

    db = f"kiln_scale_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{db}"'))
    redis.Redis.from_url(REDIS).flushdb()
    database_url = sa.make_url(PG_ADMIN).set(database=db).render_as_string(hide_password=False)
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "kiln"
        stack = EmbeddedStack(home=home, port=free_port(), workers=0, overrides={
            "KILN_DATABASE_URL": database_url, "KILN_BROKER_URL": REDIS,
            "KILN_LOG_LEVEL": "WARNING", "KILN_API_PROCESSES": str(args.api_processes),
            **({"KILN_API_AGENT_PORT": str(free_port()),
                "KILN_API_AGENT_PROCESSES": str(args.agent_processes)}
               if args.agent_processes else {}),
            "KILN_API_NICE": str(args.api_nice)})
        try:
            stack.prepare()
            model_ids = seed(database_url, (home / "store").as_uri(), home / "signing.key",
                             args.agents)
            stack.start()
            # The load generator's own full garbage collections (10,000 tasks, connections
            # and their buffers) stalled it for up to 4 s, which the latencies it takes would
            # count as the API's: it collects nothing while it measures.
            gc.collect()
            gc.freeze()
            gc.disable()
            # On uvloop, as the API serves: on asyncio's own loop the generator took about a
            # sixth more of the cores that it shares with the API.
            phases, fleet, change_s, costs = uvloop.run(
                run(args, stack, admin, db, model_ids))
            gc.enable()
        except BaseException:
            log = home / "logs" / "api.log"
            if log.exists():
                console.print("the API's log ends:\n" + "\n".join(
                    log.read_text(errors="replace").splitlines()[-60:]), markup=False)
            raise
        finally:
            stack.stop()
            with admin.connect() as conn:
                conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)'))
    report(args, phases, fleet, change_s, costs)


if __name__ == "__main__":
    main()

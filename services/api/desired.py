"""Desired state without waiting: the agents' long-polls and what wakes them.

An agent holds ``GET /v1/agents/{name}/desired-state?after=<digest>&wait=<s>`` open; the route
registers a *waiter* here, computes the agent's desired state, answers at once when its
content digest differs from ``after``, and otherwise awaits the waiter's ``asyncio.Event``:
no database connection and no thread are held while it waits.

A change wakes only the waiters it can concern, and only those recompute their state:

- a deployment created, changed or deleted: the waiters whose labels its (new) selector
  matches, and those whose last desired state names it (the old selector's agents);
- builds that finished (an artifact landed, or a build failed), artifacts recorded, and
  artifacts found broken (or whole again): the waiters whose last desired state names one of
  those models;
- a plugin version registered: every waiter that serves a model (rare; which models use the
  plugin's ops is not known here).

The same changes invalidate the process's ``DesiredStateCache``: the desired models of each
agent *profile* (labels and keys; see ``fleet.AgentProfile``), computed once for all the agents
that share it and kept until a change concerns them. A fleet of 10,000 agents on a handful of
profiles then costs a handful of computations per change, however many long-polls it wakes,
and a long-poll renewed with nothing changed costs one read of the agent's row.

Changes made through this API process wake at once (``deployment_changed``, called by the
deployments router after its commit). What changes behind its back — a deployment changed
through another API replica, a build a worker finished — is found by a cheap periodic
re-check (``Rechecker``, every ``KILN_DESIRED_STATE_RECHECK_S``): one small query of the
deployments' generations, one each of the models of jobs finished and of artifacts recorded
since the last check, one of the broken artifacts (indexed) and one of the plugins' count and
newest version. It runs only while some agent waits or something is cached, on SQLite and
PostgreSQL alike. Its cost
is per API process and per interval, not per agent, and it needs nothing beside the
database (no LISTEN connection, no pub/sub channel that a worker would also have to publish
on), which is why it was chosen over PostgreSQL's LISTEN/NOTIFY or Redis pub/sub: a change
reaches another replica's agents within one interval. The API's own findings (an artifact
its cache hit found broken, a plugin uploaded to it) act at once. A failed build's backoff
ending is bounded by the entry's expiry at its ``retry_at``; anything else by the cache's
lifetime, ``KILN_DESIRED_STATE_CACHE_S``.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, TypeVar

import sqlalchemy as sa
from sqlalchemy.orm import Session

from schemas.agents import DesiredModel, DesiredState
from schemas.rollouts import Rollout
from services.db import repo
from services.db.repo.artifacts import BROKEN
from services.db.tables import ArtifactRow, CompileJobRow, DeploymentRow, PluginRow, utcnow

if TYPE_CHECKING:
    from services.api.fleet import AgentProfile

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: How far back each re-check looks for finished jobs before the previous one (a job's
#: transaction may commit a moment after the finish time it records).
RECHECK_OVERLAP = timedelta(seconds=5)
#: How often the whole re-check runs at the most (builds finished, artifacts, plugins,
#: registrations), seconds; deployments are looked at every ``KILN_DESIRED_STATE_RECHECK_S``.
FULL_RECHECK_S = 1.0
#: The name of the re-check's thread.
RECHECK_THREAD = "kiln-desired-recheck"
#: The most agent profiles a process keeps (about 1 KB each); past it, all are read again.
MAX_PROFILES = 200_000
#: Long-polls that go on in one pass of the event loop (``LoopPace``); the rest wait for the
#: next pass, after the requests that arrived meanwhile. Each answers whole in its pass
#: (state, signature, and the response out through the middleware), so a heartbeat that
#: arrives during a thousand-agent change waits behind up to this many of them
#: (`bench/scale.py` measures a thousand agents woken at once).
TURNS_PER_PASS = 4


@dataclass(eq=False)
class Waiter:
    """One held long-poll. ``labels`` is ``None`` until its first computation (then any
    change wakes it: nothing is known yet that would rule it out)."""

    agent: str
    loop: asyncio.AbstractEventLoop
    event: asyncio.Event = field(default_factory=asyncio.Event)
    labels: dict[str, str] | None = None
    deployments: frozenset[str] = frozenset()
    models: frozenset[str] = frozenset()
    #: How many times something woke it.
    wakes: int = 0
    #: The changes that arrived while nothing was known of it (``labels`` ``None``): judged
    #: again against what its computation then learned, so that a change that concerns
    #: another agent does not cost it a second computation.
    pending: list[Callable[[Waiter], bool]] = field(default_factory=list)

    def learn(self, labels: dict[str, str], desired: DesiredState) -> None:
        """What its computation found. Runs on the waiter's loop, as ``notify`` does, so a
        change notified after this is judged against what was learned here."""
        first = self.labels is None
        self.labels = dict(labels)
        self.deployments = frozenset(m.deployment_id for m in desired.models)
        self.models = frozenset(m.model_id for m in desired.models)
        pending, self.pending = self.pending, []
        if first and self.event.is_set() and not any(matches(self) for matches in pending):
            self.event.clear()  # woken only by changes that turn out not to concern it

    def notify(self, matches: Callable[[Waiter], bool]) -> None:
        """A change that may concern it (on its loop)."""
        if self.labels is None:
            self.pending.append(matches)
        self.event.set()

    def selected_by(self, selector: dict[str, str]) -> bool:
        labels = self.labels
        return labels is None or all(labels.get(k) == v for k, v in selector.items())


@dataclass(eq=False)
class _Cached:
    labels: dict[str, str]
    models: list[DesiredModel]
    deployments: frozenset[str]
    model_ids: frozenset[str]
    #: ``time.monotonic()`` after which the entry is computed again.
    expires: float


class DesiredStateCache:
    """The desired models per agent profile, computed once and kept until a change concerns
    them (``deployment_changed``, ``models_changed``) or ``ttl_s`` passes; ``ttl_s`` 0
    disables it. Agents of one profile asking at once wait for one computation (a change
    wakes thousands of long-polls together). Thread-safe."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._entries: dict[str, _Cached] = {}
        self._computing: dict[str, threading.Lock] = {}
        #: Bumped by every invalidation: a computation that began before one is not kept.
        self._epoch = 0
        self.computations = 0
        self.hits = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def models(self, profile: AgentProfile,
               compute: Callable[[], list[DesiredModel]]) -> list[DesiredModel]:
        if self.ttl_s <= 0:
            self.computations += 1
            return compute()
        key = profile.key
        if (entry := self._fresh(key)) is not None:
            return entry.models
        with self._lock:
            gate = self._computing.setdefault(key, threading.Lock())
        with gate:
            if (entry := self._fresh(key)) is not None:  # computed while this one waited
                return entry.models
            with self._lock:
                epoch = self._epoch
            models = compute()
            self.computations += 1
            expires = time.monotonic() + self.ttl_s
            now = utcnow()
            for model in models:  # a failed build is retried when its backoff ends
                if model.retry_at is not None:
                    expires = min(expires, time.monotonic()
                                  + max(0.0, (model.retry_at - now).total_seconds()))
            with self._lock:
                if self._epoch == epoch:
                    self._entries[key] = _Cached(
                        labels=dict(profile.labels), models=models,
                        deployments=frozenset(m.deployment_id for m in models),
                        model_ids=frozenset(m.model_id for m in models), expires=expires)
                if self._computing.get(key) is gate:
                    del self._computing[key]
        return models

    def kept(self, profile: AgentProfile) -> list[DesiredModel] | None:
        """The profile's models if they are kept and fresh, else ``None`` (nothing blocks)."""
        if self.ttl_s <= 0:
            return None
        entry = self._fresh(profile.key)
        return entry.models if entry is not None else None

    def _fresh(self, key: str) -> _Cached | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            if entry.expires <= time.monotonic():
                del self._entries[key]
                return None
            self.hits += 1
            return entry

    def _drop(self, concerned: Callable[[_Cached], bool]) -> int:
        now = time.monotonic()
        with self._lock:
            self._epoch += 1
            gone = [k for k, e in self._entries.items() if e.expires <= now or concerned(e)]
            for key in gone:
                del self._entries[key]
        return len(gone)

    def deployment_changed(self, deployment_id: str, selector: dict[str, str] | None) -> int:
        """Forget the profiles whose models name the deployment or whose labels its (new)
        selector matches. Returns how many were forgotten."""
        return self._drop(lambda e: deployment_id in e.deployments or (
            selector is not None and all(e.labels.get(k) == v for k, v in selector.items())))

    def models_changed(self, model_ids: frozenset[str]) -> int:
        return self._drop(lambda e: not e.model_ids.isdisjoint(model_ids))

    def clear(self) -> None:
        self._drop(lambda _: True)


class LoopPace:
    """Turns on one event loop: at most ``per_pass`` callers of ``turn`` go on in one pass of
    the loop; the others wait, in order, for the passes after it, and the I/O that arrived
    meanwhile (a heartbeat, a renewal) is served between them.

    A change wakes a thousand long-polls at once. Each computes, signs and sends its answer
    on the loop (no thread), so in one pass they would hold every heartbeat that arrived
    meanwhile for a second or more; paced, a heartbeat waits behind ``per_pass`` of them."""

    def __init__(self, loop: asyncio.AbstractEventLoop, per_pass: int = TURNS_PER_PASS) -> None:
        self.loop = loop
        self.per_pass = per_pass
        self._used = 0
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self._scheduled = False

    async def turn(self) -> None:
        if self._used < self.per_pass and not self._waiting:
            self._used += 1
            self._schedule()
            return
        future = self.loop.create_future()
        self._waiting.append(future)
        self._schedule()
        await future  # a caller cancelled meanwhile is skipped by ``_next_pass``

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self._next_pass)

    def _next_pass(self) -> None:
        self._scheduled = False
        self._used = 0
        while self._waiting and self._used < self.per_pass:
            future = self._waiting.popleft()
            if not future.done():
                future.set_result(None)
                self._used += 1
        if self._used:
            self._schedule()


@dataclass
class _LoopShare:
    """What the long-polls on one event loop share."""

    pace: LoopPace
    #: Profile key (or ``agent:<name>`` while the agent's profile is not known) → the
    #: computation in a thread that the long-polls of that profile wait for.
    flights: dict[str, asyncio.Future[None]] = field(default_factory=dict)


class DesiredStateHub:
    """The waiters of one API process. Thread-safe: routes run in the threadpool, the
    re-check in a thread of its own; an event is set on its waiter's loop."""

    def __init__(self, *, cache_s: float = 0.0) -> None:
        self.cache = DesiredStateCache(cache_s)
        self._lock = threading.Lock()
        self._waiters: set[Waiter] = set()
        #: Agent name → its profile less the rollouts (labels and keys), read once and kept
        #: until the agent registers again (here, or through another replica: the re-check)
        #: or its row goes. With the rollouts kept too, a long-poll renewed with nothing
        #: changed reads nothing from the database. Nothing is kept with ``cache_s`` 0.
        self._profiles: dict[str, AgentProfile] = {}
        #: The active rollouts, as last read, and when that read is too old
        #: (``time.monotonic()``); dropped by every deployment change (a rollout that
        #: admits or halts touches its deployment) before the waiters concerned wake.
        self._rollouts: tuple[list[Rollout], float] | None = None
        #: Bumped by every drop of either: a read that began before one is not kept.
        self._reads = 0
        #: Deployment id → generation as last seen (by this process's changes or the
        #: re-check), so a change made here is not woken for twice.
        self._generations: dict[str, int] | None = None
        self._finished_seen: set[str] = set()
        #: Broken artifact id → its model, and the plugins' (count, newest), as last seen.
        self._broken: dict[str, str] | None = None
        self._plugins: tuple[int, datetime | None] | None = None
        self.wakes = 0
        self.closing = False
        self._shares: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopShare] = (
            weakref.WeakKeyDictionary())
        #: Computations run in a thread by ``recompute``, and those it spared.
        self.recomputed = self.shared = 0

    # ------------------------------------------------------------ waiters
    def close(self) -> None:
        """The API is stopping: every held long-poll answers now, and new ones at once."""
        self.closing = True
        self.wake_all("the API is stopping")

    def subscribe(self, agent: str) -> Waiter:
        waiter = Waiter(agent=agent, loop=asyncio.get_running_loop())
        with self._lock:
            self._waiters.add(waiter)
        return waiter

    def _share(self) -> _LoopShare:
        loop = asyncio.get_running_loop()
        share = self._shares.get(loop)
        if share is None:
            share = self._shares[loop] = _LoopShare(pace=LoopPace(loop))
        return share

    async def turn(self) -> None:
        """Wait for a turn of this event loop's ``LoopPace``."""
        await self._share().pace.turn()

    async def recompute(self, name: str, compute: Callable[[], T],
                        kept: Callable[[], T | None],
                        in_thread: Callable[[Callable[[], T]], Awaitable[T]]) -> T:
        """``compute()`` through ``in_thread``, one computation per agent profile at a time on
        this event loop: an agent whose profile another long-poll is computing waits for it
        and then finds the result kept (``kept()``), without a thread of its own. A change
        wakes a thousand long-polls of a few profiles; when each took a thread, they queued
        for the threads and fought the event loop for the interpreter lock, and the
        heartbeats behind them waited for the whole burst (``bench/scale.py`` reports the
        heartbeats near a deployment change apart)."""
        share = self._share()
        base = self.kept_profile(name)
        key = base.key if base is not None else f"agent:{name}"
        while (flight := share.flights.get(key)) is not None:
            await asyncio.shield(flight)  # cancelled here, the others still wait for it
            await share.pace.turn()  # the profile's long-polls then go on a few per pass
            if (found := kept()) is not None:
                self.shared += 1
                return found
        flight = asyncio.get_running_loop().create_future()
        share.flights[key] = flight
        try:
            self.recomputed += 1
            return await in_thread(compute)
        finally:
            del share.flights[key]
            flight.set_result(None)

    def unsubscribe(self, waiter: Waiter) -> None:
        with self._lock:
            self._waiters.discard(waiter)

    def waiting(self) -> int:
        with self._lock:
            return len(self._waiters)

    def active(self) -> bool:
        """Whether changes must be watched: some agent waits, or something is cached."""
        return bool(self.waiting() or len(self.cache) or self._profiles)

    # ------------------------------------------------------------ what renewals read
    def profile(self, name: str, read: Callable[[], AgentProfile]) -> AgentProfile:
        """The agent's profile less the rollouts: kept, or ``read()`` (in the caller's
        thread) and kept."""
        if self.cache.ttl_s <= 0:
            return read()
        if (kept := self.kept_profile(name)) is not None:
            return kept
        with self._lock:
            reads = self._reads
        profile = read()
        with self._lock:
            if self._reads == reads:
                if len(self._profiles) >= MAX_PROFILES:  # bounded, whatever comes and goes
                    self._profiles.clear()
                self._profiles[name] = profile
        return profile

    def kept_profile(self, name: str) -> AgentProfile | None:
        with self._lock:
            return self._profiles.get(name)

    def kept_rollouts(self) -> list[Rollout] | None:
        with self._lock:
            if self._rollouts is not None and self._rollouts[1] > time.monotonic():
                return self._rollouts[0]
            return None

    def rollouts(self, read: Callable[[], list[Rollout]]) -> list[Rollout]:
        """The active rollouts: kept (at most ``cache_s``), or ``read()`` and kept."""
        if self.cache.ttl_s <= 0:
            return read()
        if (kept := self.kept_rollouts()) is not None:
            return kept
        with self._lock:
            reads = self._reads
        rollouts = read()
        with self._lock:
            if self._reads == reads:
                self._rollouts = (rollouts, time.monotonic() + self.cache.ttl_s)
        return rollouts

    def agents_changed(self, names: Iterable[str]) -> None:
        """These agents registered again (their labels or keys may differ) or are gone."""
        with self._lock:
            self._reads += 1
            for name in names:
                self._profiles.pop(name, None)

    def wake_all(self, why: str) -> int:
        return self._wake(lambda _: True, why)

    def _wake(self, matches: Callable[[Waiter], bool], why: str) -> int:
        with self._lock:
            woken = [w for w in self._waiters if matches(w)]
        for waiter in woken:
            waiter.wakes += 1
            waiter.loop.call_soon_threadsafe(waiter.notify, matches)
        self.wakes += len(woken)
        if woken:
            logger.debug("woke %d long-poll(s) (%s)", len(woken), why)
        return len(woken)

    # ------------------------------------------------------------ changes
    def deployment_changed(self, deployment_id: str, selector: dict[str, str] | None, *,
                           generation: int | None = None) -> int:
        """A deployment was created or changed (``selector`` its new one), or deleted
        (``selector`` ``None``). Wakes the agents it selects now and those that had it."""
        with self._lock:
            if self._generations is not None:
                if generation is None:
                    self._generations.pop(deployment_id, None)
                else:
                    self._generations[deployment_id] = generation
            self._rollouts = None  # a rollout that admitted or halted touched its deployment
            self._reads += 1
        self.cache.deployment_changed(deployment_id, selector)  # before anyone recomputes
        return self._wake(
            lambda w: deployment_id in w.deployments
            or (selector is not None and w.selected_by(selector)),
            f"deployment {deployment_id}")

    def models_changed(self, model_ids: Iterable[str]) -> int:
        """Builds of these models finished: wakes the agents whose state names one."""
        ids = frozenset(model_ids)
        self.cache.models_changed(ids)
        return self._wake(lambda w: w.labels is None or not w.models.isdisjoint(ids),
                          f"{len(ids)} model(s) built")

    def plugins_changed(self) -> int:
        """A plugin version was registered: an ``exact`` engine built with an older version
        of it now comes with the build of its successor. Which models use the plugin's ops is
        not known here, so every profile is computed again and every waiter that serves a
        model is woken (plugin uploads are rare)."""
        self.cache.clear()
        return self._wake(lambda w: w.labels is None or bool(w.models), "a plugin version")

    def recheck(self, session: Session, since: datetime) -> None:
        """Compare the deployments' generations with the last seen, and wake for the
        deployments that differ and for the models of jobs finished after ``since``."""
        self.recheck_deployments(session)
        self._recheck_the_rest(session, since)

    def recheck_deployments(self, session: Session) -> None:
        """The deployments part of ``recheck`` alone (one query): what a deployment or a
        rollout changed through another process, which agents expect within 0.1 s."""
        rows = session.execute(sa.select(DeploymentRow.id, DeploymentRow.generation,
                                         DeploymentRow.selector)).all()
        now = {row.id: (row.generation, dict(row.selector)) for row in rows}
        with self._lock:
            before, self._generations = self._generations, {k: g for k, (g, _) in now.items()}
        if before is None:  # no baseline: what was cached may predate a change unseen
            self.cache.clear()
            with self._lock:
                self._profiles.clear()
                self._rollouts = None
                self._reads += 1
        else:
            for deployment_id, (generation, selector) in now.items():
                if before.get(deployment_id) != generation:
                    self.deployment_changed(deployment_id, selector, generation=generation)
            for deployment_id in before.keys() - now.keys():
                self.deployment_changed(deployment_id, None)

    def _recheck_the_rest(self, session: Session, since: datetime) -> None:
        # Agents registered (again) through another replica: their labels or keys may differ.
        again = repo.registered_since(session, since - RECHECK_OVERLAP)
        if again:
            self.agents_changed(again)
        # A job finished just before ``since`` may commit just after the last check: the
        # window overlaps, and jobs already seen are not woken for again.
        # A job answered from the cache changed nobody's desired state (its artifact was
        # there already): at 200 cached submissions a second, counting them woke every
        # long-poll of the model's agents over and over.
        rows = [*session.execute(sa.select(CompileJobRow.id, CompileJobRow.model_id).where(
            CompileJobRow.finished_at > since - RECHECK_OVERLAP,
            CompileJobRow.cache_hit.is_(False))),
            *session.execute(sa.select(ArtifactRow.id, ArtifactRow.model_id).where(
                ArtifactRow.created_at > since - RECHECK_OVERLAP))]
        with self._lock:
            fresh = {row.model_id for row in rows if row.id not in self._finished_seen}
            self._finished_seen = {row.id for row in rows}
        # Artifacts found broken (by another process's cache hit or a store check) or whole
        # again: the agents handed them must be told. The set is small and indexed.
        broken = {row.id: row.model_id for row in session.execute(
            sa.select(ArtifactRow.id, ArtifactRow.model_id).where(
                ArtifactRow.state == BROKEN))}
        plugins = tuple(session.execute(
            sa.select(sa.func.count(), sa.func.max(PluginRow.created_at))).one())
        with self._lock:
            broken_before, self._broken = self._broken, broken
            plugins_before, self._plugins = self._plugins, plugins
        if broken_before is not None:
            fresh |= {broken[a] for a in broken.keys() - broken_before.keys()}
            fresh |= {broken_before[a] for a in broken_before.keys() - broken.keys()}
        if fresh:
            self.models_changed(fresh)
        if plugins_before is not None and plugins != plugins_before:
            self.plugins_changed()


class Rechecker:
    """A thread running ``hub.recheck`` every ``interval_s`` while some agent waits; it also
    wakes every waiter when the online key changed (``key_id()``, a rotation), so that each
    gets an envelope signed by the new key at once."""

    def __init__(self, hub: DesiredStateHub, session_factory: Callable[[], Session], *,
                 interval_s: float, key_id: Callable[[], str] | None = None) -> None:
        self.hub = hub
        self.session_factory = session_factory
        self.key_id = key_id
        self._key: str | None = None
        self.interval_s = interval_s
        #: How often the whole re-check runs; the deployments alone every ``interval_s``.
        self.full_interval_s = max(FULL_RECHECK_S, interval_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=RECHECK_THREAD,
                                        daemon=True)
        self.checks = itertools.count()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        since = utcnow()
        try:  # the baseline that the first change is compared with
            with self.session_factory() as session:
                self.hub.recheck(session, since)
        except Exception:
            logger.warning("first look at the deployments failed", exc_info=True)
        last_full = time.monotonic()
        while not self._stop.wait(self.interval_s):
            if not self.hub.active():
                since = utcnow()
                continue
            started, full = utcnow(), time.monotonic() - last_full >= self.full_interval_s
            try:
                if self.key_id is not None:
                    key, self._key = self._key, self.key_id()
                    if key is not None and key != self._key:
                        self.hub.wake_all("the online key changed")
                with self.session_factory() as session:
                    if full:
                        self.hub.recheck(session, since)
                    else:
                        self.hub.recheck_deployments(session)
                if full:
                    since, last_full = started, time.monotonic()
                next(self.checks)
            except Exception:  # the database may be away for a while; the next try follows
                logger.warning("re-check of desired-state changes failed", exc_info=True)

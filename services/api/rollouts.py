"""The rollout controller: admits agents stage by stage, judges the gates they report, halts
and rolls back a failing cohort, and decides which model each agent of a deployment runs.

Who runs what follows the rollout's cohorts (``services.api.fleet.which_deployment``): an
agent admitted to the new model in its cohort gets the deployment as changed; every other
agent the deployment selects gets the rollout's starting point (``previous``). A halt
empties the cohort's admitted list, so its agents' next desired state names the previous
artifact again; the agent keeps serving what it has until that one is verified and swapped
in (it already holds it in its cache: it was serving it before).

``step`` runs on a timer (``RolloutController``, every ``KILN_ROLLOUT_INTERVAL_S``) and at once
when an agent reports a failing gate, so a failed canary's agents are told to go back within
one long-poll wake of the report.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime

from sqlalchemy.orm import Session, sessionmaker

from schemas.errors import Conflict
from schemas.rollouts import (
    CohortState,
    CohortStatus,
    ErrorRateGate,
    GateResult,
    LatencyGate,
    OnHalt,
    Rollout,
    RolloutPolicy,
    RolloutReport,
    RolloutState,
    admitted,
)
from services.api.desired import DesiredStateHub
from services.api.fleet import cohort_key
from services.api.periodic import PeriodicThread
from services.db import repo, session_scope
from services.db.tables import utcnow

logger = logging.getLogger(__name__)


def judge(policy: RolloutPolicy, report: RolloutReport | None) -> tuple[bool | None, str]:
    """(True, "") when every gate of the policy passed in ``report``, (False, why) when one
    failed, (None, what is missing) while a result is still missing. The numbers are judged
    against the policy's thresholds here, not by the agent."""
    if report is None:
        return None, "no report yet"
    results: dict[str, GateResult] = {g.name: g for g in report.gates}
    for gate in policy.gates:
        result = results.get(gate.name)
        if result is None:
            return None, f"no {gate.name} result yet"
        if isinstance(gate, LatencyGate) and result.emulated:
            continue  # emulated timings are never compared with the build host's (no figure)
        if isinstance(gate, LatencyGate) and result.p50_ms is not None \
                and result.benchmark_p50_ms:
            ratio = result.p50_ms / result.benchmark_p50_ms
            if ratio > gate.max_ratio:
                return False, (f"latency gate: p50 {result.p50_ms:.3g} ms is {ratio:.2f}x the "
                               f"benchmark's {result.benchmark_p50_ms:.3g} ms (at most "
                               f"{gate.max_ratio:g}x)")
            continue
        if isinstance(gate, ErrorRateGate) and result.requests is not None \
                and result.errors is not None:
            if result.requests < gate.min_requests:
                return None, f"{result.requests} of {gate.min_requests} requests served"
            rate = result.errors / result.requests if result.requests else 0.0
            if rate > gate.max_rate:
                return False, (f"error-rate gate: {result.errors} of {result.requests} "
                               f"requests failed ({rate:.2%}, at most {gate.max_rate:.2%})")
            continue
        if not result.passed:
            what = result.detail or "failed"
            if gate.name == "golden" and result.worst_index is not None:
                what += (f" (worst element {result.worst_index}: abs error "
                         f"{result.max_abs_error}, rel error {result.max_rel_error})")
            return False, f"{gate.name} gate: {what}"
    return True, ""


def _halt(cohort: CohortStatus, reason: str, *, roll_back: bool) -> None:
    cohort.state = CohortState.HALTED
    cohort.halt_reason = reason
    if roll_back:
        cohort.rolled_back = sorted({*cohort.rolled_back, *cohort.admitted})
        cohort.admitted = []


def step(session: Session, rollout: Rollout, *, now: datetime | None = None) -> bool:
    """Move one rollout (locked by the caller) forward; True when who runs what changed."""
    now = now or utcnow()
    if rollout.state not in (RolloutState.RUNNING, RolloutState.PAUSED):
        return False
    deployment = repo.get_deployment_by_id(session, deployment_id=rollout.deployment_id)
    policy = rollout.policy
    members: dict[str, list[str]] = {}
    for agent in repo.list_agents(session):
        if agent.alive and deployment.selects(agent.labels):
            key = cohort_key(deployment, agent)
            if key is not None:
                members.setdefault(key, []).append(agent.name)
    reports = repo.rollout_reports(session, rollout_id=rollout.id)
    cohorts = {c.key: c for c in rollout.cohorts}
    before = {k: (c.state, list(c.admitted)) for k, c in cohorts.items()}
    halted: list[str] = []
    for key, names in sorted(members.items()):
        cohort = cohorts.setdefault(key, CohortStatus(
            key=key, state=CohortState.RUNNING, stage=0, stage_started_at=now, agents=0,
            admitted=[]))
        cohort.agents = len(names)
        if cohort.state is CohortState.HALTED:
            continue
        verdicts = {name: judge(policy, reports.get(name)) for name in cohort.admitted}
        failed = [(name, why) for name, (ok, why) in verdicts.items() if ok is False]
        if failed:
            name, why = failed[0]
            _halt(cohort, f"agent {name}: {why}", roll_back=True)
            halted.append(key)
            logger.warning("rollout %s halted cohort %s: %s", rollout.id, key, cohort.halt_reason)
            continue
        soaked = (now - cohort.stage_started_at).total_seconds() >= policy.soak_s
        if (rollout.state is RolloutState.RUNNING and cohort.state is CohortState.RUNNING
                and cohort.admitted and soaked
                and all(ok for ok, _ in verdicts.values())
                and len(cohort.admitted) >= admitted(policy.stages[cohort.stage], len(names))):
            if cohort.stage + 1 < len(policy.stages):
                cohort.stage += 1
                cohort.stage_started_at = now
            else:
                cohort.state = CohortState.COMPLETED
        if rollout.state is RolloutState.RUNNING or cohort.state is CohortState.COMPLETED:
            # Admit up to the stage's share (agents that joined the cohort count too).
            target = len(names) if cohort.state is CohortState.COMPLETED \
                else admitted(policy.stages[cohort.stage], len(names))
            gone = set(cohort.admitted) - set(names)
            cohort.admitted = [n for n in cohort.admitted if n not in gone]
            for name in sorted(names):
                if len(cohort.admitted) >= target:
                    break
                if name not in cohort.admitted:
                    cohort.admitted.append(name)
    if halted and policy.on_halt is not OnHalt.CONTINUE:
        for key, cohort in cohorts.items():
            if key not in halted and cohort.state is not CohortState.HALTED:
                _halt(cohort, f"cohort {halted[0]} halted ({policy.on_halt.value})",
                      roll_back=policy.on_halt is OnHalt.ROLLBACK_ALL)
    rollout.cohorts = [cohorts[k] for k in sorted(cohorts)]
    states = {c.state for c in rollout.cohorts}
    if rollout.cohorts and states == {CohortState.COMPLETED}:
        rollout.state = RolloutState.COMPLETED
    elif rollout.cohorts and states == {CohortState.HALTED}:
        rollout.state = RolloutState.HALTED
        rollout.reason = "every cohort halted"
    repo.save_rollout(session, rollout=rollout)
    after = {k: (c.state, list(c.admitted)) for k, c in cohorts.items()}
    return after != before or rollout.state is RolloutState.COMPLETED


class Rollouts:
    """What the routes and the timer call: each action in its own transaction, then the
    agents concerned are woken."""

    def __init__(self, sessions: sessionmaker[Session] | Callable[[], Session],
                 hub: DesiredStateHub) -> None:
        self.sessions = sessions
        self.hub = hub

    def _changed(self, session: Session, rollout: Rollout) -> None:
        generation = repo.touch_deployment(session, deployment_id=rollout.deployment_id)
        session.commit()
        deployment = repo.get_deployment_by_id(session, deployment_id=rollout.deployment_id)
        self.hub.deployment_changed(deployment.id, deployment.selector, generation=generation)

    def advance(self, rollout_id: str) -> Rollout:
        with session_scope(self.sessions) as session:
            rollout = repo.get_rollout(session, rollout_id=rollout_id, lock=True)
            if step(session, rollout):
                self._changed(session, rollout)
            else:
                session.commit()
            return rollout

    def run_once(self) -> int:
        with session_scope(self.sessions) as session:
            ids = [r.id for r in repo.list_rollouts(session, active_only=True)]
        for rollout_id in ids:
            self.advance(rollout_id)
        return len(ids)

    def report(self, rollout_id: str, report: RolloutReport) -> Rollout:
        # Recorded and judged in one transaction, the rollout locked: a failing gate halts
        # now, not at the next tick, and no other report of the same agent (its next window,
        # landing a moment later) can replace this one before it is judged.
        with session_scope(self.sessions) as session:
            rollout = repo.get_rollout(session, rollout_id=rollout_id, lock=True)
            if not rollout.state.active:
                raise Conflict(f"rollout {rollout_id} is {rollout.state.value}; it takes no "
                               "reports", rollout=rollout_id, state=rollout.state.value)
            repo.record_rollout_report(session, rollout_id=rollout_id, report=report)
            if step(session, rollout):
                self._changed(session, rollout)
            else:
                session.commit()
            return rollout

    def act(self, rollout_id: str, action: str) -> Rollout:
        """``pause``, ``resume`` or ``abort``; Conflict when the rollout's state forbids it."""
        allowed = {"pause": {RolloutState.RUNNING},
                   "resume": {RolloutState.PAUSED},
                   "abort": {RolloutState.RUNNING, RolloutState.PAUSED, RolloutState.HALTED}}
        with session_scope(self.sessions) as session:
            rollout = repo.get_rollout(session, rollout_id=rollout_id, lock=True)
            if rollout.state not in allowed[action]:
                raise Conflict(
                    f"cannot {action} rollout {rollout_id}: it is {rollout.state.value} "
                    f"(possible from: {', '.join(sorted(s.value for s in allowed[action]))})",
                    rollout=rollout_id, state=rollout.state.value)
            if action == "pause":
                rollout.state = RolloutState.PAUSED
            elif action == "resume":
                rollout.state = RolloutState.RUNNING
                for cohort in rollout.cohorts:  # the soak restarts: the pause was not a soak
                    cohort.stage_started_at = utcnow()
            else:
                rollout.state = RolloutState.ABORTED
                rollout.reason = "aborted by an operator"
                repo.revert_deployment(session, rollout=rollout)
            rollout = repo.save_rollout(session, rollout=rollout)
            self._changed(session, rollout)
            return rollout


class RolloutController(PeriodicThread):
    name = "kiln-rollouts"
    what = "rollout pass"

    def __init__(self, rollouts: Rollouts, *, interval_s: float) -> None:
        super().__init__(interval_s=interval_s)
        self.rollouts = rollouts

    def run_once(self) -> int:
        return self.rollouts.run_once()

"""Which engine an agent gets when several verified ones would run there.

A model that more than one of the agent's backends builds (a ``torch.export`` program:
AOTInductor, and onnxruntime through the ONNX exporter) has one artifact per backend. The
control plane gives the agent the fastest, by the p50 latency each recorded when it was built
(every artifact is verified before it is recorded, so each candidate passed its numerics):

1. the best tier first: ``exact`` (built for the node's own key) before ``compatible`` before
   ``fallback``, whatever the latencies: an engine built for this hardware beats one that
   merely runs here;
2. within that tier, the lowest recorded p50 wins;
3. ties (equal p50s), and tiers where a candidate has no recorded p50 (nothing to compare it
   with), go to the agent's backend order of preference (the order it reports its keys in,
   or the deployment's ``options.backends``).

Artifacts the agent refused to run (its executor's typed refusal, reported in its heartbeat)
are not among ``usable``: the caller leaves them out, and the answer names them and why
(``refused``), so an operator sees why a node runs a lower tier or another backend.

The answer says why (``schemas.agents.EngineChoice``) and travels in the signed desired
state. Pure functions: no I/O, no database.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from schemas.agents import EngineCandidate, EngineChoice
from schemas.manifest import ArtifactSummary

#: Resolution tiers an engine may come from, best first.
TIERS = ("exact", "compatible", "fallback")


@dataclass(frozen=True)
class Usable:
    """A verified, ready artifact the agent can run, and the tier it would run at."""

    artifact: ArtifactSummary
    tier: str


def recorded_p50(artifact: ArtifactSummary) -> float | None:
    """The p50 recorded at build time, or ``None`` where none was (a row without a
    benchmark records 0)."""
    p50 = artifact.p50_ms
    return p50 if p50 is not None and p50 > 0 else None


def choose_engine(usable: Sequence[Usable], preference: Sequence[str], *,
                  missing: Mapping[str, str] | None = None,
                  refused: Mapping[str, str] | None = None,
                  ) -> tuple[Usable, EngineChoice] | None:
    """The engine to give the agent among ``usable``, and why; ``None`` when there is none.

    ``preference``: backend names, most preferred first (a backend not listed comes after
    those listed, by name). ``missing``: backends planned for the agent that offer no engine,
    and why (recorded in the answer only). ``refused``: artifact id → why the agent refused it
    (recorded in the answer; a refused artifact among ``usable`` is a caller's error).
    """
    for item in usable:
        if item.tier not in TIERS:
            raise ValueError(f"unknown tier {item.tier!r}; expected one of {TIERS}")
        if refused and item.artifact.id in refused:
            raise ValueError(f"artifact {item.artifact.id} was refused by the agent "
                             f"({refused[item.artifact.id]}); it is not usable")
    if not usable:
        return None
    order = list(preference)

    def rank(item: Usable) -> tuple[int, str, str]:
        backend = item.artifact.backend
        return (order.index(backend) if backend in order else len(order), backend,
                item.artifact.id)

    tier = min((item.tier for item in usable), key=TIERS.index)
    pool = sorted((item for item in usable if item.tier == tier), key=rank)
    timed = [(item, p50) for item in pool if (p50 := recorded_p50(item.artifact)) is not None]
    if len(pool) == 1:
        chosen, reason = pool[0], "only"
        why = f"the only {tier} engine"
    elif len(timed) < len(pool):
        chosen, reason = pool[0], "preference"
        untimed = sorted(i.artifact.backend for i in pool if recorded_p50(i.artifact) is None)
        why = (f"no recorded p50 for {', '.join(untimed)}: the agent's backend preference "
               f"({', '.join(order) or 'none'}) decides among the {tier} engines")
    else:
        low = min(p50 for _, p50 in timed)
        fastest = [item for item, p50 in timed if p50 == low]
        chosen = fastest[0]  # ``pool`` is in order of preference, so is ``fastest``
        others = ", ".join(f"{item.artifact.backend} {p50:.3f} ms" for item, p50 in timed
                           if item is not chosen)
        if len(fastest) > 1:
            reason = "tie"
            why = (f"{len(fastest)} {tier} engines share the lowest recorded p50 "
                   f"({low:.3f} ms): the agent's backend preference picks "
                   f"{chosen.artifact.backend}")
        else:
            reason = "fastest"
            why = (f"the lowest recorded p50 of the {tier} engines: "
                   f"{chosen.artifact.backend} {low:.3f} ms (vs {others})")
    lower = sorted({item.tier for item in usable} - {tier}, key=TIERS.index)
    if lower:
        why += f"; {'/'.join(lower)} engines are not weighed against {tier} ones"
    if missing:
        why += "; no engine from " + ", ".join(f"{b} ({r})" for b, r in sorted(missing.items()))
    if refused:
        why += "; " + _refused_text(refused)
    weighed = [chosen] + [item for item in sorted(usable, key=lambda i: (TIERS.index(i.tier),
                                                                          rank(i)))
                          if item is not chosen]
    return chosen, EngineChoice(
        reason=reason, tier=tier, message=why, missing=dict(missing or {}),
        candidates=[EngineCandidate(artifact_id=item.artifact.id,
                                    backend=item.artifact.backend, tier=item.tier,
                                    p50_ms=recorded_p50(item.artifact)) for item in weighed])


def _refused_text(refused: Mapping[str, str]) -> str:
    return "the agent refused " + "; ".join(f"artifact {a} ({why})"
                                            for a, why in sorted(refused.items()))


def nothing_left(refused: Mapping[str, str], missing: Mapping[str, str] | None = None,
                 ) -> EngineChoice:
    """The answer when every engine the agent could have had is one it refused: none to run
    until another lands (the caller queues a portable build where a worker makes one)."""
    why = "no engine left to run: " + _refused_text(refused)
    if missing:
        why += "; no engine from " + ", ".join(f"{b} ({r})" for b, r in sorted(missing.items()))
    return EngineChoice(reason="refused", tier="none", message=why, missing=dict(missing or {}))

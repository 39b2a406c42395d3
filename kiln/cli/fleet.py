"""``kiln`` commands that deploy through the API and watch the fleet: deployments, rollouts,
agents, workers, and which fingerprint keys each deployment covers."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

import typer
from rich.table import Table

from kiln.cli.common import (
    ApiUrl,
    AtolOpt,
    FullOpt,
    JsonOpt,
    LevelOpt,
    OptionsFile,
    RtolOpt,
    Token,
    compile_options,
    console,
    err,
    open_client,
)
from kiln.output import dump, print_json, print_row, print_table, short_ids
from schemas.options import Portability, Precision, Tune


def _parse_selector(items: list[str] | None) -> dict[str, str]:
    selector: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"{item!r}: expected key=value", param_hint="--selector")
        selector[key.strip()] = value.strip()
    return selector


def deploy(
    model_id: Annotated[str, typer.Argument(help="model id (its sha256), from `kiln submit`")],
    name: Annotated[str, typer.Option(help="deployment name = the name agents serve it as")],
    selector: Annotated[list[str] | None, typer.Option(
        "--selector", "-l", help="label key=value an agent must have; repeatable")] = None,
    precision: Annotated[Precision | None, typer.Option(
        "--precision", help="as `kiln submit --precision` (default, with no other option "
        "given: the options of the model's latest build, so its engine is served as built)")]
    = None,
    opt_level: LevelOpt = None,
    tune: Annotated[Tune | None, typer.Option("--tune", help="as `kiln submit --tune`")] = None,
    portability: Annotated[Portability | None, typer.Option(
        "--portability", help="as `kiln submit --portability`")] = None,
    atol: AtolOpt = None,
    rtol: RtolOpt = None,
    options_file: OptionsFile = None,
    stages: Annotated[str | None, typer.Option(help=(
        "roll a change out in stages per fingerprint cohort, e.g. '1,10%,100%' (counts of "
        "agents, then percentages; the last is 100%)"))] = None,
    soak_s: Annotated[float, typer.Option(help="seconds each stage soaks with its gates "
                                               "passing")] = 60.0,
    gate: Annotated[list[str] | None, typer.Option(
        help="a rollout gate: golden, latency or error_rate; repeatable (default golden)")]
    = None,
    on_halt: Annotated[str, typer.Option(help=(
        "when a cohort halts, the others: continue, halt_others or rollback_all"))]
    = "continue",
    wait: Annotated[bool, typer.Option(
        "--wait", help="wait until every live agent it selects serves its engine")] = False,
    timeout: Annotated[float, typer.Option(help="seconds to wait")] = 1800,
    as_json: JsonOpt = False,
    api_url: ApiUrl = None,
    token_: Token = None,
) -> None:
    """Create or update a deployment: the agents whose labels match serve the model. With
    --stages, a change of model or options rolls out stage by stage behind gates. Without
    compile options, the deployment asks for those of the model's latest build."""
    from kiln.client import DeploymentApplied, DeploymentHandle

    rollout = None
    if stages is not None:
        rollout = {"stages": [s.strip() for s in stages.split(",")], "soak_s": soak_s,
                   "gates": [{"name": g} for g in (gate or ["golden"])], "on_halt": on_halt}
    given = (precision, opt_level, tune, portability, atol, rtol, options_file)
    with open_client(api_url, token_) as client:
        built = None if any(v is not None for v in given) else client.built_options(model_id)
        if built is not None:
            options, origin = built, "those of the model's latest build"
        else:
            options = compile_options(precision or Precision.FP32, opt_level, atol, rtol,
                                      options_file, tune or Tune.AUTO,
                                      portability or Portability.EXACT)
            origin = "as given" if any(v is not None for v in given) else \
                "the defaults (the model has no successful build yet)"
        applied = DeploymentApplied.model_validate(client.deploy(
            name, model_id, selector=_parse_selector(selector), options=options,
            rollout=rollout))
        d = applied.deployment
        err.print(f"deployment {d.name} (generation {d.generation}) → model {d.model_id}, "
                  f"selector {d.selector or 'every agent'}; options {origin}: precision "
                  f"{d.options.precision.value}, tune {d.options.tune.value} (digest "
                  f"{d.options_digest[:12]})", highlight=False)
        if applied.build_jobs:
            err.print(f"[yellow]queued {len(applied.build_jobs)} build(s)[/]: the agents it "
                      f"selects have no engine of model {d.model_id[:12]} with these options "
                      f"for their hardware: jobs {', '.join(applied.build_jobs)}"
                      + ("" if built is not None or origin == "as given" else
                         "; pass --precision etc. to deploy an engine built otherwise"),
                      highlight=False)
        if applied.rollout is not None:
            err.print(f"rollout {applied.rollout.id} started (`kiln rollouts`)")
        agents = None
        if wait:
            handle = DeploymentHandle(client, applied)
            with err.status("waiting for the builds and the selected agents") as status:
                def update(rows) -> None:
                    ready = sum(1 for r in rows if r.ready)
                    status.update(f"{ready}/{len(rows)} selected agents serve {d.name}")

                agents = handle.wait(timeout, on_update=update)
    if as_json:
        body = applied.model_dump(mode="json")
        if agents is not None:
            body["agents"] = dump(agents)
        print_json(body)
        return
    print_row(d.name, d.generation, d.model_id, ",".join(applied.build_jobs) or "-")
    for agent in agents or []:
        print_row(agent.agent, agent.state, agent.artifact_id, agent.tier)


def rollouts(as_json: JsonOpt = False, active: Annotated[bool, typer.Option(
        help="only running, paused or halted ones")] = False,
        api_url: ApiUrl = None, token_: Token = None) -> None:
    """Rollouts: each cohort's stage, admitted agents and the reason of any halt."""
    with open_client(api_url, token_) as client:
        rows = client.list_rollouts(active=active)
    if as_json:
        print_json(rows)
        return
    table = Table()
    for col in ("rollout", "deployment", "state", "stages", "cohort", "stage", "admitted",
                "halt reason"):
        table.add_column(col, overflow="fold")
    for r in rows:
        stages = " → ".join(str(s) for s in r["policy"]["stages"])
        head = [r["id"][:12], r["deployment"], r["state"], stages]
        if not r["cohorts"]:
            table.add_row(*head, "-", "-", "-", r.get("reason") or "")
        for c in r["cohorts"]:
            share = r["policy"]["stages"][c["stage"]]
            table.add_row(*head, c["key"], f"{c['stage'] + 1}/{len(r['policy']['stages'])} "
                          f"({share}) {c['state']}", f"{len(c['admitted'])}/{c['agents']}",
                          c.get("halt_reason") or (r.get("reason") or ""))
            head = ["", "", "", ""]
    print_table(console, table)


class RolloutAction(StrEnum):
    PAUSE = "pause"
    RESUME = "resume"
    ABORT = "abort"


def rollout(
    action: Annotated[RolloutAction, typer.Argument(help="pause, resume or abort")],
    ref: Annotated[str, typer.Argument(help="rollout id, or a deployment name (its newest "
                                            "rollout)")],
    as_json: JsonOpt = False, api_url: ApiUrl = None, token_: Token = None,
) -> None:
    """Pause a rollout (no stage advances; failing gates still halt), resume it, or abort
    it (the deployment goes back to the model it had before, on every agent)."""
    with open_client(api_url, token_) as client:
        r = client.rollout_action(ref, action.value)
    if as_json:
        print_json(r)
        return
    console.print(f"rollout {r['id']} of {r['deployment']}: {r['state']}")


def deployments(as_json: JsonOpt = False, full: FullOpt = False, api_url: ApiUrl = None,
                token_: Token = None) -> None:
    """List deployments."""
    with open_client(api_url, token_) as client:
        rows = client.list_deployments()
    if as_json:
        print_json(rows)
        return
    models = short_ids([d["model_id"] for d in rows], console, full=full)
    digests = short_ids([d["options_digest"] for d in rows], console, full=full)
    table = Table()
    for col in ("name", "model", "selector", "generation", "options digest"):
        table.add_column(col, overflow="fold")
    for d in rows:
        selector = ",".join(f"{k}={v}" for k, v in d["selector"].items()) or "*"
        table.add_row(d["name"], models(d["model_id"]), selector, str(d["generation"]),
                      digests(d["options_digest"]))
    print_table(console, table)


def agents(as_json: JsonOpt = False, full: FullOpt = False, api_url: ApiUrl = None,
           token_: Token = None) -> None:
    """List runtime agents: labels, fingerprint keys, last heartbeat, what each serves."""
    with open_client(api_url, token_) as client:
        rows = client.list_agents()
    if as_json:
        print_json(rows)
        return
    arts = short_ids([m["artifact_id"] for a in rows for m in a["models"]
                      if m.get("artifact_id")], console, full=full)
    table = Table()
    for col in ("agent", "alive", "labels", "fingerprint keys", "last seen", "models"):
        table.add_column(col, overflow="fold")
    for a in rows:
        labels = ",".join(f"{k}={v}" for k, v in a["labels"].items())
        models = "; ".join(
            f"{m['deployment']}: {m['state']}"
            + (f" {arts(m['artifact_id'])}" if m.get("artifact_id") else "")
            + (f" ({m['error']['code']})" if m.get("error") else "")
            for m in a["models"]
        )
        trust = a.get("trust") or {}
        alive = "yes" if a["alive"] else "no"
        if trust.get("stale"):  # its signed desired state expired: it serves what it had
            alive += " (stale)"
        if trust.get("refused"):
            models += f" [refused desired state: {trust['refused']['code']}]"
        table.add_row(a["name"], alive, labels,
                      ", ".join(a["fingerprint_keys"].values()), a["last_seen"][:19], models)
    print_table(console, table)


def workers(as_json: JsonOpt = False, api_url: ApiUrl = None, token_: Token = None) -> None:
    """List compiler workers: the keys each serves, its state and last heartbeat (workers
    gone longer than KILN_WORKER_PRUNE_S are forgotten)."""
    with open_client(api_url, token_) as client:
        rows = client.list_workers()
    if as_json:
        print_json(rows)
        return
    table = Table()
    for col in ("worker", "state", "fingerprint keys", "last heartbeat", "started"):
        table.add_column(col, overflow="fold")
    for w in rows:
        table.add_row(w["name"], w["state"], "\n".join(w["fingerprint_keys"]),
                      w["last_seen"][:19], w["started_at"][:19])
    print_table(console, table)


def fleet(as_json: JsonOpt = False, api_url: ApiUrl = None, token_: Token = None) -> None:
    """The fingerprint keys in the fleet (nodes and workers each), and for each deployment
    which keys run an exact engine and which a fallback."""
    with open_client(api_url, token_) as client:
        summary = client.fleet()
    if as_json:
        print_json(summary)
        return
    keys = Table(title="fingerprint keys")
    for col in ("fingerprint key", "backend", "nodes (alive)", "workers"):
        keys.add_column(col)
    for k in summary["keys"]:
        keys.add_row(k["fingerprint_key"], k["backend"], f"{k['agents']} ({k['alive_agents']})",
                     str(k["workers"]) if k["workers"] else "0: builds wait for hardware")
    print_table(console, keys)
    coverage = Table(title="deployments")
    for col in ("deployment", "exact", "compatible / fallback", "nothing yet"):
        coverage.add_column(col)
    for d in summary["deployments"]:
        by_tier: dict[str, list[str]] = {}
        for key, tier in d["keys"].items():
            by_tier.setdefault(tier, []).append(key)
        coverage.add_row(
            d["deployment"], "\n".join(by_tier.get("exact", [])),
            "\n".join(f"{k} ({t})" for t in ("compatible", "fallback")
                      for k in by_tier.get(t, [])),
            "\n".join(by_tier.get("none", [])),
        )
    print_table(console, coverage)

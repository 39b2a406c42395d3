"""The variant matrix on real processes: one stack (API + one worker on this machine), one
engine per precision built here for real (fp32 and int8 by onnxruntime, bf16 by OpenVINO), and
one ``kiln agent`` per declared chip variant, each registering with its own fingerprint file.
What each agent is served (artifact, tier), whether the engine's signed requirements hold on
it, and which build the control plane queued for it, read back from the API and the agents.

Shared by ``tests/integration/test_variant_matrix.py`` (which asserts on it) and
``bench/variants.py`` (which prints it as a table)."""

from __future__ import annotations

import base64
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from kiln.client import KilnClient
from kiln.stack import EmbeddedStack
from runtime_agent.executors import node_fingerprint_keys
from runtime_agent.executors.openvino.executor import has_bf16
from runtime_agent.fingerprint import declare_variant, detect_fingerprint
from schemas.fingerprint import (
    CpuInfo,
    HardwareFingerprint,
    core_class,
    unmet_requirements,
)
from schemas.jobs import JobStatus
from schemas.options import CompileOptions, Precision, Tune
from tests.integration.agents import AgentProcess, outputs

#: What a retune's key carries after the node's own key (the planner's context suffix).
CONTEXT_MARK = "-t-"


def variants(here: HardwareFingerprint) -> list[str]:
    """The declared variants (``declare_variant``'s names; ``here``: this machine as it
    detects itself). The core count is one of another core-count class than this machine's."""
    cores = 64 if core_class(64) != core_class(here.cpu.cores) else 2
    return ["here", "no-vnni", "no-amx-bf16", f"cores={cores}", "older", "aarch64"]

#: The options of each precision's engine, the smallest that still make a real engine of it.
#: Optimization level 3 is pinned: hardware-specific engines, so requirements and tiers do not
#: turn on which level a tuner picks. fp32 is tuned (its thread-policy candidates race, so the
#: core class decides its winner); int8 and bf16 build their one default candidate: dynamic
#: int8 without ``reduce_range`` (it needs an int8 dot-product instruction), and OpenVINO's
#: bf16 inference precision.
ENGINES = {
    "fp32": CompileOptions(backends=["onnxruntime"], precision=Precision.FP32,
                           optimization_level=3, benchmark_iterations=20),
    "int8": CompileOptions(backends=["onnxruntime"], precision=Precision.INT8, tune=Tune.OFF,
                           optimization_level=3, benchmark_iterations=20),
    "bf16": CompileOptions(backends=["openvino"], precision=Precision.BF16, tune=Tune.OFF,
                           benchmark_iterations=20),
}

_VNNI = {"avx512_vnni", "avx_vnni", "amx_int8"}

LABELS = "matrix=yes"

X = {"x": np.random.default_rng(0).normal(size=(4, 64)).astype(np.float32)}


def not_buildable_here(precision: str, cpu: CpuInfo) -> str | None:
    """Why this machine cannot build ``precision``'s engine for real (the column is then
    skipped, never faked), or ``None``."""
    if cpu.arch != "x86_64":
        return f"the variants are declared from an x86_64 host; this one is {cpu.arch}"
    if precision == "int8" and not _VNNI & set(cpu.features):
        return ("no int8 dot-product instruction (AVX-512 VNNI, AVX-VNNI or AMX-INT8): the int8 "
                "engine would be quantized with reduce_range and require none")
    if precision == "bf16" and not has_bf16(cpu):
        return "neither AVX-512 BF16 nor AMX-BF16: OpenVINO builds no bf16 engine here"
    return None


def write_fingerprints(directory: Path) -> dict[str, HardwareFingerprint]:
    """One fingerprint file per variant in ``directory`` (``<variant>.json``)."""
    here = detect_fingerprint()
    declared = {v: here if v == "here" else declare_variant(here, v) for v in variants(here)}
    for variant, fingerprint in declared.items():
        (directory / f"{slug(variant)}.json").write_text(fingerprint.model_dump_json())
    return declared


def slug(variant: str) -> str:
    return variant.replace("=", "-")


@dataclass
class Cell:
    """What one variant's agent gets for one precision's deployment."""

    variant: str
    precision: str
    #: The artifact the agent serves (``None``: nothing).
    artifact_id: str | None
    #: ``exact``, ``compatible``, ``fallback`` or ``none``.
    tier: str
    #: The served engine's backend, and whether it is the engine built for this column.
    backend: str | None
    built_here: bool
    #: The column's engine's signed requirements that the variant does not meet.
    unmet: list[str]
    #: The served engine's requirements that the variant does not meet (must stay empty).
    served_unmet: list[str]
    #: The control plane's reason, when it refused the engine for this node.
    refused: bool
    #: The key of the build the control plane queued for this node (``None``: none).
    queued_key: str | None
    queued_status: str | None
    #: The node's own key for the column's backend (``None``: it has none).
    node_key: str | None
    #: The agent answered an inference within the engine's tolerance (``None``: not served).
    inferred: bool | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def retune(self) -> bool:
        """A tuning for the node's own context was queued: a key of its own base key with a
        tuning context appended (whatever the context part's shape)."""
        key = self.queued_key or ""
        return bool(self.node_key) and key.startswith(self.node_key) and CONTEXT_MARK in key

    @property
    def queued(self) -> str:
        if self.queued_key is None:
            return "-"
        kind = "retune" if self.retune else "build"
        return f"{kind} ({self.queued_status})"


def build_engines(client: KilnClient, model_id: str, precisions: list[str],
                  timeout_s: float = 600) -> dict[str, str]:
    """Each precision's engine for this machine's key, built by the stack's worker: artifact
    ids by precision."""
    keys = node_fingerprint_keys(detect_fingerprint())
    jobs = {p: client.create_jobs(model_id, [keys[ENGINES[p].backends[0]]], ENGINES[p])[0]
            for p in precisions}
    built = {}
    for precision, job in jobs.items():
        done = client.wait_job(job.id, timeout_s=timeout_s)
        if done.status is not JobStatus.SUCCEEDED:
            raise AssertionError(f"the {precision} engine did not build: {done.error}")
        built[precision] = done.artifact_id
    return built


def desired_state(stack: EmbeddedStack, name: str) -> dict[str, dict]:
    """The control plane's answer for agent ``name`` (read with the admin token), by
    deployment. The agent verifies its signature; here it is read for what it says."""
    response = httpx.get(f"{stack.api_url}/v1/agents/{name}/desired-state",
                         headers={"Authorization": f"Bearer {stack.token}"}, timeout=30)
    assert response.status_code == 200, response.text
    payload = json.loads(base64.b64decode(json.loads(response.content)["payload"]))
    return {m["deployment"]: m for m in payload["models"]}


def settle(stack: EmbeddedStack, client: KilnClient, model_id: str,
           agents: dict[str, AgentProcess], precisions: list[str],
           timeout_s: float = 300, strict: bool = True) -> dict[str, dict[str, dict]]:
    """Wait until no build this worker can take is in flight and every agent serves what the
    control plane chose for it; the desired states, by variant and deployment. Not
    ``strict``: the states at the deadline (the agents' failures then show in the cells)."""
    deadline = time.monotonic() + timeout_s
    while True:
        busy = [j for j in client.list_jobs(model_id=model_id)
                if j.status in (JobStatus.QUEUED, JobStatus.RUNNING)]
        states = {v: desired_state(stack, a.name) for v, a in agents.items()}
        lagging = []
        for variant, agent in agents.items():
            assert agent.proc is not None and agent.proc.poll() is None, agent.log.read_text()
            served = agent.models()
            for precision in precisions:
                want = states[variant].get(precision, {}).get("artifact_id")
                have = (served.get(precision) or {}).get("artifact_id")
                if want != have:
                    lagging.append((variant, precision, want, have))
        if not busy and not lagging:
            return states
        if time.monotonic() > deadline:
            if not strict and not busy:
                return states
            raise AssertionError(f"the matrix did not settle within {timeout_s}s: jobs in "
                                 f"flight {[(j.fingerprint_key, j.status) for j in busy]}, "
                                 f"agents behind {lagging}")
        time.sleep(0.5)


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def observe(stack: EmbeddedStack, client: KilnClient, engines: dict[str, str],
            fingerprints: dict[str, HardwareFingerprint], agents: dict[str, AgentProcess],
            states: dict[str, dict[str, dict]], reference: dict[str, np.ndarray],
            ) -> list[Cell]:
    """The matrix's cells, with an inference on every agent that serves something."""
    manifests: dict[str, object] = {}

    def manifest(artifact_id: str):
        if artifact_id not in manifests:
            manifests[artifact_id] = client.get_manifest(artifact_id)
        return manifests[artifact_id]

    cells = []
    for variant, agent in agents.items():
        fingerprint = fingerprints[variant]
        keys = node_fingerprint_keys(fingerprint)
        served = agent.models()
        for precision, built in engines.items():
            backend = ENGINES[precision].backends[0]
            want = states[variant].get(precision, {})
            have = served.get(precision) or {}
            artifact_id = have.get("artifact_id")
            engine = manifest(built)
            unmet = unmet_requirements(engine.requirements, fingerprint, keys.get(backend))
            served_unmet: list[str] = []
            served_backend = None
            if artifact_id:
                served_manifest = manifest(artifact_id)
                served_backend = served_manifest.backend
                if served_manifest.requirements is not None:
                    served_unmet = unmet_requirements(served_manifest.requirements, fingerprint,
                                                      keys.get(served_backend))
            queued_key = queued_status = None
            if want.get("job_id"):
                job = client.get_job(want["job_id"])
                queued_key, queued_status = job.fingerprint_key, job.status.value
            choice = (want.get("choice") or {}).get("message", "")
            cell = Cell(variant=variant, precision=precision, artifact_id=artifact_id,
                        tier=(have.get("tier") or "none") if artifact_id else "none",
                        backend=served_backend, built_here=artifact_id == built,
                        unmet=unmet, served_unmet=served_unmet,
                        refused="requirements unmet" in choice, queued_key=queued_key,
                        queued_status=queued_status, node_key=keys.get(backend))
            if artifact_id:
                got = outputs(agent.infer(precision, X))["y"]
                gate = ENGINES[precision].accuracy.threshold
                cell.inferred = (bool(np.allclose(got, reference["y"], rtol=1e-4, atol=1e-5))
                                 if precision == "fp32" else _cosine(got, reference["y"]) >= gate)
            if want.get("artifact_id") and want["artifact_id"] != artifact_id:
                cell.notes.append(f"chosen {want['artifact_id'][:12]} ({want.get('tier')}), "
                                  f"not served by the agent")
            cells.append(cell)
    return cells


def start_agents(stack: EmbeddedStack, workdir: Path,
                 variants: list[str]) -> dict[str, AgentProcess]:
    """One ``kiln agent`` per variant, all started at once, each with its fingerprint file."""
    agents = {}
    for variant in variants:
        agent = AgentProcess(stack, f"v-{slug(variant)}", LABELS, workdir)
        agents[variant] = agent.start("--fingerprint-file",
                                      str(workdir / f"{slug(variant)}.json"))
    return agents


def wait_registered(client: KilnClient, agents: dict[str, AgentProcess],
                    timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    names = {a.name for a in agents.values()}
    while names - {a["name"] for a in client.list_agents()}:
        for agent in agents.values():
            assert agent.proc is not None and agent.proc.poll() is None, agent.log.read_text()
        assert time.monotonic() < deadline, f"agents not registered: {names}"
        time.sleep(0.3)

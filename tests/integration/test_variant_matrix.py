"""The variant matrix against real API, worker and agent processes: six declared variants of
this machine (as it is, without VNNI, without AVX-512 BF16 and AMX, another core-count class,
one x86-64 level down, aarch64), each a ``kiln agent`` registering with its fingerprint file,
x an fp32, an int8 and a bf16 engine that this machine's worker builds for real.

No agent may be served an engine whose signed requirements it lacks; each gets the tier the
rules give it, a retune exactly where its tuning context differs in what decided the winner,
and, where served, answers an inference. A precision this CPU cannot build for real (no VNNI,
no AVX-512 BF16) is skipped with the reason, never stood in for by a written manifest
(``tests/services/api/test_requirements_matrix.py`` runs the matrix that way, API only).

``bench/variants.py`` prints the same matrix as a table."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kiln.examples import mlp
from runtime_agent.fingerprint import declare_variant, detect_fingerprint, isa_class
from tests.integration.agents import reference
from tests.integration.conftest import running_stack, wait_for_worker
from tests.integration.variants import (
    ENGINES,
    LABELS,
    Cell,
    X,
    build_engines,
    not_buildable_here,
    observe,
    settle,
    start_agents,
    wait_registered,
    write_fingerprints,
)

# The first test's budget holds the module's setup: three builds, the portable builds the
# lower variants ask for, and six agents loading their engines.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

HERE = detect_fingerprint()
#: Columns left out for a known defect of Kiln, not a property of the CPU (the reason, by
#: precision); `bench/variants.py` still shows such a column. None at present.
KNOWN_DEFECTS: dict[str, str] = {}
SKIPPED = {p: why for p in ENGINES
           if (why := KNOWN_DEFECTS.get(p) or not_buildable_here(p, HERE.cpu))}


@pytest.fixture(scope="module")
def matrix(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[tuple[str, str], Cell]]:
    for precision, why in SKIPPED.items():
        print(f"variant matrix: the {precision} column is skipped on this CPU: {why}")
    precisions = [p for p in ENGINES if p not in SKIPPED]
    if not precisions:
        pytest.skip(f"this CPU builds none of the matrix's engines: {SKIPPED}")
    workdir = tmp_path_factory.mktemp("matrix")
    running = running_stack(request, workdir)
    stack = next(running)
    client = stack.client()
    agents = {}
    try:
        wait_for_worker(client)
        fingerprints = write_fingerprints(workdir)
        model = mlp(seed=27).SerializeToString()
        model_id = client.upload_model(model).id
        engines = build_engines(client, model_id, precisions)
        for precision in precisions:
            client.deploy(precision, model_id, selector=dict([LABELS.split("=")]),
                          options=ENGINES[precision])
        agents = start_agents(stack, workdir, list(fingerprints))
        wait_registered(client, agents)
        states = settle(stack, client, model_id, agents, precisions)
        cells = observe(stack, client, engines, fingerprints, agents, states, reference(model, X))
        yield {(c.variant, c.precision): c for c in cells}
    finally:
        for agent in agents.values():
            agent.kill()
        client.close()
        running.close()  # stops the stack


def expected(variant: str, precision: str) -> tuple[str, bool, str]:
    """(tier, refused by the engine's requirements, build queued: ``-``, ``retune`` for the
    node's own tuning context, ``build`` for its own key) for a host with VNNI and AVX-512
    BF16, as the rules give them (docs/fingerprints.md)."""
    features = set(HERE.cpu.features)
    if variant == "aarch64":
        # No aarch64 worker, and no x86 engine runs there: its own builds wait for hardware.
        return "none", False, "build"
    if precision == "bf16":
        # An OpenVINO blob's key names every kernel feature of its CPU: a node whose key
        # differs has no engine, and its own build waits for a worker of its key.
        return ("exact", False, "-") if variant == "here" or variant.startswith("cores=") \
            else ("none", False, "build")
    if variant == "older":
        # Its key differs: its own build waits for hardware. Meanwhile it falls back to a
        # portable engine of the model a worker here builds (the portable int8 one needs an
        # int8 dot product the level below lacks, so int8 falls back to the portable fp32 one).
        return "fallback", False, "build"
    if variant.startswith("cores="):
        # Thread policies raced in the fp32 tuning only: the core class decided that winner.
        return ("compatible", False, "retune") if precision == "fp32" else ("exact", False, "-")
    if variant == "no-vnni" and precision == "int8":
        # Quantized without reduce_range: saturates without VNNI. Refused, its own tuning
        # queued, and meanwhile the model's portable fp32 engine serves it.
        return "fallback", True, "retune"
    if variant == "no-amx-bf16" and precision == "int8" and "amx_int8" in features:
        return "compatible", False, "retune"  # AMX-INT8 was one of the features it raced on
    return "exact", False, "-"


#: What each engine needs on any node, stated apart from the requirements its manifest signs
#: (so a requirement the backend forgot to sign is caught too): this machine's x86-64 level
#: for the level-3 and OpenVINO engines built here, an int8 dot-product instruction for int8 without
#: reduce_range, native bf16 for bf16.
NEEDS = {"fp32": set(), "int8": {"avx512_vnni", "avx_vnni", "amx_int8"},
         "bf16": {"avx512_bf16", "amx_bf16"}}


def test_no_agent_is_served_an_engine_whose_requirements_it_lacks(matrix):
    fingerprints = {v: declare_variant(HERE, v) if v != "here" else HERE
                    for v in {v for v, _ in matrix}}
    for (variant, precision), cell in matrix.items():
        assert not cell.served_unmet, (variant, precision, cell.artifact_id, cell.served_unmet)
        if cell.unmet:
            assert not cell.built_here, (variant, precision, cell.tier, cell.unmet)
        if cell.built_here:
            cpu = fingerprints[variant].cpu
            assert cpu.arch == "x86_64" and isa_class(cpu) == isa_class(HERE.cpu), \
                (variant, precision)
            if NEEDS[precision]:
                assert NEEDS[precision] & set(cpu.features), (variant, precision, cell.tier)


@pytest.mark.parametrize("precision", list(ENGINES))
def test_each_variant_gets_its_tier_and_its_retune(matrix, precision):
    if precision in SKIPPED:
        pytest.skip(f"the {precision} column: {SKIPPED[precision]}")
    got = {v: (c.tier, c.refused, "retune" if c.retune else "build" if c.queued_key else "-")
           for (v, p), c in matrix.items() if p == precision}
    assert len(got) >= 6
    want = {v: expected(v, precision) for v in got}
    assert got == want
    for variant in got:
        cell = matrix[variant, precision]
        if cell.tier in ("exact", "compatible"):
            assert cell.built_here and not cell.unmet, cell
        if cell.artifact_id:
            assert cell.inferred, (variant, precision, cell.artifact_id)

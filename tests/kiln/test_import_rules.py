"""The import contracts that keep ``kiln`` from importing the control plane and the worker
(pyproject.toml) name every kiln module but the two that compile in-process, so a new module
cannot slip out of the rule, and none of them is waived by an ``ignore_imports``."""

from __future__ import annotations

import tomllib
from pathlib import Path

import kiln

ROOT = Path(__file__).resolve().parents[2]
#: What may use the worker's libraries in-process: `kiln compile`/`kiln run`, and kiln.torch.
IN_PROCESS = {"kiln.cli.local", "kiln.torch"}
SIDES = {"services", "services.**", "compiler_worker", "compiler_worker.**"}


def _kiln_modules() -> set[str]:
    folder = Path(kiln.__file__).parent
    found = set()
    for path in folder.rglob("*.py"):
        parts = path.relative_to(folder.parent).with_suffix("").parts
        found.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


def _kiln_contracts() -> list[dict]:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"][
        "contracts"]
    return [c for c in contracts if c["type"] == "forbidden"
            and any(m == "kiln" or m.startswith("kiln.") for m in c["source_modules"])
            and set(c["forbidden_modules"]) >= SIDES]


def test_every_kiln_module_but_the_in_process_ones_is_forbidden_both_sides() -> None:
    contracts = _kiln_contracts()
    assert contracts, "no contract forbids kiln the control plane and the worker"
    listed = [m for c in contracts for m in c["source_modules"]]
    assert len(listed) == len(set(listed)), f"a module is listed twice: {sorted(listed)}"
    missing = _kiln_modules() - IN_PROCESS - set(listed)
    assert not missing, (f"kiln modules outside the import rule (add each to a contract in "
                         f"pyproject.toml): {sorted(missing)}")
    assert not set(listed) & IN_PROCESS
    assert not set(listed) - _kiln_modules(), "a listed module does not exist"
    for contract in contracts:
        # Each module is itself, not its package's descendants (kiln.cli would hold
        # kiln.cli.local), and the rule is never waived.
        assert contract.get("as_packages") is False, contract["name"]
        assert not contract.get("ignore_imports"), contract["name"]


def test_only_the_modules_that_reach_the_in_process_ones_allow_indirect_imports() -> None:
    for contract in _kiln_contracts():
        if contract.get("allow_indirect_imports"):
            assert set(contract["source_modules"]) <= {"kiln.cli", "kiln.cli.__main__",
                                                       "kiln.torch_backend"}, contract["name"]


def test_no_import_contract_waives_a_kiln_import() -> None:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"][
        "contracts"]
    waived = [rule for c in contracts for rule in c.get("ignore_imports", [])
              if rule.startswith("kiln")]
    assert waived == []

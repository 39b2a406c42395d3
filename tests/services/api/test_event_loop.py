"""No statement runs on the API's event loop: every ``async def`` in ``services/`` hands its
database work to a thread. On the loop, one statement waiting for SQLite's write lock (the
embedded stack) froze every request of the process for the busy timeout, and a request whose
transaction only that loop could end held the lock meanwhile
(``test_models_upload.py::test_an_upload_waiting_for_the_database_leaves_the_api_answering``
shows it on the model upload; this test keeps the rule for every coroutine)."""

from __future__ import annotations

import ast
from pathlib import Path

import services

#: What a coroutine may call on a session without a statement: nothing waits on the database.
HARMLESS = {"close", "in_transaction", "rollback"}


def _statements_on_the_loop(source: str) -> list[tuple[int, str, str]]:
    """(line, coroutine, call) for each ``repo.*`` call and each session method other than
    ``HARMLESS`` made in an ``async def`` itself (not in a function nested in it, which runs
    in a thread)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.AsyncFunctionDef):
            continue
        stack = list(ast.iter_child_nodes(node))
        while stack:
            child = stack.pop()
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                continue
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute):
                owner = ast.unparse(child.func.value)
                if owner == "repo" or owner.startswith("repo.") or (
                        owner == "session" and child.func.attr not in HARMLESS):
                    found.append((child.lineno, node.name, ast.unparse(child.func)))
            stack.extend(ast.iter_child_nodes(child))
    return found


def test_no_coroutine_runs_a_statement_on_the_event_loop() -> None:
    root = Path(services.__file__).parent
    offenders = [f"{path.relative_to(root.parent)}:{line} {coroutine}: {call}"
                 for path in sorted(root.rglob("*.py"))
                 for line, coroutine, call in _statements_on_the_loop(path.read_text())]
    assert not offenders, offenders


def test_the_check_sees_a_statement_on_the_loop() -> None:
    source = '''
async def route(session):
    def in_a_thread():
        return repo.get_model(session, model_id="x")
    await run_in_threadpool(in_a_thread)
    session.rollback()
    model = repo.upsert_model(session, sha256="y")
    session.commit()
'''
    assert [call for _, _, call in _statements_on_the_loop(source)] in (
        ["repo.upsert_model", "session.commit"], ["session.commit", "repo.upsert_model"])

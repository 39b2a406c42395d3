"""The ``kiln`` command line is one module per role, its commands registered in ``kiln.cli``."""

from __future__ import annotations

import inspect
from pathlib import Path

from kiln.cli import admin, app, fleet, local, remote, serve

ROLES = (serve, admin, remote, fleet, local)


def _callbacks(typer_app) -> set:
    found = {info.callback for info in typer_app.registered_commands}
    if typer_app.registered_callback is not None:
        found.add(typer_app.registered_callback.callback)
    for group in typer_app.registered_groups:
        found |= _callbacks(group.typer_instance)
    return found


def test_every_command_a_role_module_defines_is_registered() -> None:
    # A command is registered by kiln.cli, apart from the module that defines it: one left out
    # there would be missing from `kiln` with nothing else failing. Helpers are private.
    registered = _callbacks(app)
    for module in ROLES:
        public = [obj for name, obj in vars(module).items()
                  if inspect.isfunction(obj) and obj.__module__ == module.__name__
                  and not name.startswith("_")]
        assert public, module.__name__
        missing = [f.__name__ for f in public if f not in registered]
        assert not missing, f"{module.__name__} defines commands kiln.cli does not register: " \
                            f"{missing}"


def test_no_cli_module_grows_past_600_lines() -> None:
    folder = Path(serve.__file__).parent
    sizes = {path.name: len(path.read_text().splitlines()) for path in folder.glob("*.py")}
    assert max(sizes.values()) <= 600, sizes

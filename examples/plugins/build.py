"""Assemble the example plugin folders (and, with ``--pack``, their bundle archives).

    python examples/plugins/build.py OUT [--pack]

``OUT/swish/`` is a copy of ``examples/plugins/swish``. ``OUT/ortx-inverse/`` is
``examples/plugins/ortx-inverse`` plus ``lib/libortextensions.so``, a copy of the installed
onnxruntime-extensions library (never committed), with ``plugin.json``'s version set to that
package's version and the implementation's ABI tag computed here: ``<os>-<arch>`` of this
machine and ``ort-api-<N>``, where ``N`` is the onnxruntime C API version the library asks
for at least — what its exported ``GetActiveOrtAPIVersion()`` returns before it has been
registered with any session (it negotiates upwards from there). ``--pack`` also writes
``OUT/<name>-<version>.tar`` for each, as ``kiln plugin build`` would.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
LIBRARY = "lib/libortextensions.so"


def _platform_tag() -> str:
    machine = platform.machine().lower()
    arch = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
    return f"{platform.system().lower()}-{arch}"


def library_abi(path: Path) -> str:
    """The ABI tag of an onnxruntime-extensions library file (see the module docstring)."""
    library = ctypes.CDLL(str(path))
    library.GetActiveOrtAPIVersion.restype = ctypes.c_int
    return f"{_platform_tag()}/ort-api-{library.GetActiveOrtAPIVersion()}"


def build_swish(out: Path) -> Path:
    target = out / "swish"
    shutil.copytree(HERE / "swish", target, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    return target


def build_ortx_inverse(out: Path) -> Path:
    import onnxruntime_extensions

    target = out / "ortx-inverse"
    shutil.copytree(HERE / "ortx-inverse", target, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__", "lib"))
    library = target / LIBRARY
    library.parent.mkdir(exist_ok=True)
    shutil.copyfile(onnxruntime_extensions.get_library_path(), library)
    manifest = json.loads((target / "plugin.json").read_text())
    manifest["version"] = onnxruntime_extensions.__version__
    for implementation in manifest["implementations"]:
        if implementation["entry"] == LIBRARY:
            implementation["abi"] = library_abi(library)
    (target / "plugin.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return target


def build(out: Path, *, pack: bool = False) -> dict[str, Path]:
    """Assemble both folders under ``out``; with ``pack``, return the archives instead."""
    out.mkdir(parents=True, exist_ok=True)
    folders = {"swish": build_swish(out), "ortx-inverse": build_ortx_inverse(out)}
    if not pack:
        return folders
    sys.path.insert(0, str(HERE.parents[1]))
    from artifact_store.bundles import pack_bundle

    archives = {}
    for name, folder in folders.items():
        version = json.loads((folder / "plugin.json").read_text())["version"]
        archive = out / f"{name}-{version}.tar"
        pack_bundle(folder, archive)
        archives[name] = archive
    return archives


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--pack", action="store_true", help="also write the bundle archives")
    args = parser.parse_args()
    for name, path in build(args.out, pack=args.pack).items():
        print(f"{name}: {path}")  # noqa: T201 - a command-line script


if __name__ == "__main__":
    main()

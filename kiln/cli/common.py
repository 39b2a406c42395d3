"""What the ``kiln`` sub-applications share: the two consoles, the options of every command
that talks to the API, and the compile options assembled from a command's flags."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from kiln.client import KilnClient
from schemas.console import consoles
from schemas.options import CompileOptions, Portability, Precision, Tune

console, err = consoles()

ApiUrl = Annotated[str | None, typer.Option("--api", envvar="KILN_API_URL", help="API URL")]
Token = Annotated[str | None, typer.Option("--token", envvar="KILN_TOKEN", help="bearer token")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON (full ids, every field)")]
FullOpt = Annotated[bool, typer.Option(
    "--full", help="print ids whole (default: the shortest unique prefix)")]


def open_client(api: str | None, token: str | None) -> KilnClient:
    return KilnClient.from_env(api, token)


def compile_options(precision: Precision, opt_level: int | None, atol: float | None,
                    rtol: float | None, options_file: Path | None, tune: Tune = Tune.AUTO,
                    portability: Portability = Portability.EXACT) -> CompileOptions:
    """The options of a command's flags: an ``--options`` file's, each flag filling in what
    the file leaves out (``--atol``/``--rtol`` override it)."""
    data = json.loads(options_file.read_text()) if options_file else {}
    data.setdefault("precision", precision.value)
    data.setdefault("tune", tune.value)
    data.setdefault("portability", portability.value)
    if opt_level is not None:
        data.setdefault("optimization_level", opt_level)
    tolerance = data.setdefault("tolerance", {})
    if atol is not None:
        tolerance["atol"] = atol
    if rtol is not None:
        tolerance["rtol"] = rtol
    return CompileOptions.model_validate(data)


PrecisionOpt = Annotated[Precision, typer.Option(
    "--precision", help="fp32: exact within --atol/--rtol; auto: reduced precision (int8, "
    "bf16) where the accuracy gate holds on the samples; or one precision")]
LevelOpt = Annotated[int | None, typer.Option(
    "--opt-level", min=0, max=3, help="pin the optimization level (default: the tuner picks)")]
TuneOpt = Annotated[Tune, typer.Option(
    "--tune", help="auto: build, verify and benchmark every candidate, keep the fastest; "
    "off: the backend's default only")]
PortabilityOpt = Annotated[Portability, typer.Option(
    "--portability", help="exact: fastest for this hardware; portable: runs on every node of "
    "the backend's portable key")]
AtolOpt = Annotated[float | None, typer.Option("--atol")]
RtolOpt = Annotated[float | None, typer.Option("--rtol")]
OptionsFile = Annotated[
    Path | None, typer.Option("--options", help="JSON file of CompileOptions", exists=True)
]

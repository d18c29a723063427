"""`autotuner lab`: start an emulated multi-host CPU mesh, run a collective across it, stop it."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from autotuner.cli.common import app, fail

# -- lab -------------------------------------------------------------------------------------------

@app.command()
def lab(
    topology: Annotated[str, typer.Option(help="none, shared or ring")] = "shared",
    n: Annotated[int, typer.Option("-n", "--n", min=1, max=8, help="processes")] = 2,
    rate: Annotated[str, typer.Option(help="tbf rate per link, e.g. 2gbit")] = "2gbit",
) -> None:
    """Start an emulated multi-host CPU mesh, run a collective across it, and stop it."""
    from autotuner.lab import LabError, LabSpec, run_lab_smoke

    try:
        spec = LabSpec.parse(f"lab:{topology}:{n}:{rate}" if topology != "none" else f"lab:none:{n}")
        result = run_lab_smoke(spec)
    except LabError as e:
        fail(str(e))
    sys.stdout.write(json.dumps(result, indent=2, default=str) + "\n")

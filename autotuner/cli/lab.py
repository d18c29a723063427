"""`autotuner lab`: start an emulated multi-host CPU mesh, run a collective across it, stop it;
`autotuner lab run TARGET -- CMD ...`: run any command once per lab process, as on N hosts."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from autotuner.cli.common import app, err, fail

# -- lab -------------------------------------------------------------------------------------------

lab_app = typer.Typer(help="The emulated multi-host CPU mesh (see `autotuner lab run --help`).")
app.add_typer(lab_app, name="lab")


@lab_app.callback(invoke_without_command=True)
def lab(
    ctx: typer.Context,
    target: Annotated[str | None, typer.Option(help="the lab, written as every command's --target: "
                                               "lab:TOPOLOGY:N:RATE (e.g. lab:shared:2:2gbit) or lab:none:N")] = None,
    topology: Annotated[str, typer.Option(hidden=True, help="none, shared or ring (old form of --target)")] = "shared",
    n: Annotated[int, typer.Option("-n", "--n", min=1, max=8, hidden=True, help="processes (old form)")] = 2,
    rate: Annotated[str, typer.Option(hidden=True, help="tbf rate per link (old form)")] = "2gbit",
) -> None:
    """Start an emulated multi-host CPU mesh, run a collective across it, and stop it."""
    if ctx.invoked_subcommand is not None:
        return
    from autotuner.lab import LabError, LabSpec, run_lab_smoke

    try:
        old = f"lab:{topology}:{n}:{rate}" if topology != "none" else f"lab:none:{n}"
        spec = LabSpec.parse(target or old)
        result = run_lab_smoke(spec)
    except LabError as e:
        fail(str(e))
    sys.stdout.write(json.dumps(result, indent=2, default=str) + "\n")


@lab_app.command("run")
def lab_run(
    target: Annotated[str, typer.Argument(help="the lab, e.g. lab:shared:2:2gbit or lab:none:2")],
    command: Annotated[list[str] | None, typer.Argument(
        help="the command to run in every process, after `--`", show_default=False)] = None,
    service: Annotated[str | None, typer.Option(
        help="a service URL on this host (e.g. http://127.0.0.1:8000) to relay into the lab; "
             "each process finds its address in AUTOTUNER_SERVICE_URL")] = None,
    grace: Annotated[float, typer.Option(
        min=0, help="seconds between SIGTERM and SIGKILL when the others are stopped")] = 10.0,
) -> None:
    r"""Run CMD once per lab process, as on N hosts: autotuner lab run TARGET -- CMD ARGS...

    Every process runs inside the lab's namespaces and shaped links, with
    JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID set (and one CPU device, gloo
    collectives), so a multi-host JAX program runs unchanged. Output is prefixed \[p0], \[p1], ...;
    when one process fails the others are stopped and the exit status is the failed one's."""
    from autotuner.lab import LabError
    from autotuner.lab.run import run_on_lab

    try:
        result = run_on_lab(target, list(command or []), service=service, grace=grace)
    except LabError as e:
        fail(str(e))
    except OSError as e:
        fail(f"lab run: {e}")
    if result.message:
        err.print(f"[bold red]lab run:[/] {result.message}" if result.code else
                  f"lab run: {result.message}", highlight=False)
    raise typer.Exit(result.code)

"""`autotuner plan MODULE:FACTORY`: what `overlap(fn)` will do to a program, pair by pair, before
running it: one row per collective/einsum pair with its readable name, problem key, the strategy
chosen, where the choice came from and the predicted saving. The table goes to stdout (one JSON
object per pair with --json); where the winners come from goes to stderr.
"""

from __future__ import annotations

import json
import sys
import tempfile
from typing import Annotated, Any

import typer

from autotuner.cli.common import app, err, fail, fmt
from autotuner.device import ESTIMATED_LABEL
from autotuner.program.load import (
    FACTORY_HELP,
    MEMORY_HELP,
    aot_target,
    load_program,
    memory_arg,
    mesh_size,
    relaid,
)
from autotuner.program.winners import SOURCE_HELP, make_client

HELP = f"""Show what the compiler pass `autotuner.overlap` does to a program: one row per collective/einsum pair (readable name, problem key, strategy, source of the choice, predicted saving).

{FACTORY_HELP} Example: autotuner plan autotuner.examples.transformer:train_step --db sqlite:///autotuner.db

Under --strategy auto (the default) a pair runs a tuned winner only when its speedup interval lies above 1 (or, on an aot target, an estimated winner faster than plain); nearest, model and default answers stay baseline. The program is compiled, not run, on in-process CPU devices (--devices, default the mesh size, else 8), or with --target aot:tpu:TOPOLOGY for that TPU slice by XLA:TPU (libtpu, no TPU): the factory runs on CPU devices of the same mesh, its arguments are re-laid on the target's devices as abstract values, and the plan says per pair whether XLA:TPU's plain jit already decomposes it (column xla) and the step's temp memory plain vs rewritten on the target."""


def print_plan(plan: list[dict[str, Any]], notes: list[str], out: Any = None) -> None:
    """The rows of `program.factory.plan_rows` as a table, then the notes."""
    # autotuner.overlap imports in 0.16 s, which no other command needs
    from autotuner.overlap.plan import split_text

    out = out or sys.stdout
    xla = any(r.get("xla") for r in plan)   # a compiler that decomposes pairs itself (XLA:TPU)
    split = any(r.get("traffic_speedup") for r in plan)   # winners measured beside their serial control
    head = ("pair", "problem", "collective", *(("xla",) if xla else ()), "strategy", "source", "saving",
            *(("traffic x overlap",) if split else ()), "x")
    rows = [head] + [(r["name"], (r["key"] or "-")[:12], r["form"], *((r.get("xla") or "-",) if xla else ()),
                      r["strategy"], r["source"],
                      fmt(100 * r["saving"] if r["saving"] is not None else None, ".0f")
                      + ("%" if r["saving"] is not None else ""),
                      *((split_text((r["traffic_speedup"], r["overlap_speedup"]) if r.get("traffic_speedup") else None),)
                        if split else ()), str(r["count"])) for r in plan]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for row in rows:
        out.write("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() + "\n")
    n = sum(r["applied"] for r in plan)
    out.write(f"{n} of {len(plan)} pair(s) decomposed\n")
    for r in plan:
        if r["note"]:
            out.write(f"  {r['name']}: {r['note']}\n")
    for t in notes:
        out.write(f"note: {t}\n")
    out.flush()


def strategy_arg(text: str) -> Any:
    """auto | baseline | a strategy key (ring-uni-c2-u1-loop-send) | a JSON object."""
    from autotuner.strategy import Strategy, StrategyError

    if text in ("auto", "baseline"):
        return text
    if not text.lstrip().startswith("{"):
        try:
            return Strategy.from_key(text)
        except StrategyError:
            fail(f"--strategy {text!r}: expected auto, baseline, plain, a key such as ring-uni-c2-u1-loop-send, "
                 "or a JSON object")
    try:
        return Strategy.from_dict(json.loads(text))
    except (StrategyError, ValueError) as e:
        fail(f"--strategy {text!r}: {e}")


@app.command("plan", help=HELP)
def plan_cmd(
    target: Annotated[str, typer.Argument(metavar="MODULE:FACTORY", help="a factory of (fn, args)")],
    mesh: Annotated[str | None, typer.Option("--mesh", help='mesh axes, e.g. \'{"model": 4}\'')] = None,
    devices: Annotated[int | None, typer.Option("--devices", min=1, max=64,
                                                help="in-process CPU devices (default: mesh size or 8)")] = None,
    kwargs: Annotated[str | None, typer.Option("--kwargs", help="JSON object of keyword arguments "
                                               "for the factory")] = None,
    explicit: Annotated[bool, typer.Option("--explicit/--auto", help="axis types of the --mesh: Auto (the default, as for extract) or Explicit")] = False,
    db: Annotated[str | None, typer.Option("--db", help=SOURCE_HELP)] = None,
    service: Annotated[str | None, typer.Option("--service", help="service URL to read winners from")] = None,
    snapshot: Annotated[str | None, typer.Option("--snapshot", help="snapshot file of winners")] = None,
    device: Annotated[str | None, typer.Option("--device", help="whose winners: a device key (prefix) "
                                               "or label, e.g. cpu:cpux4/lab-shared-2gbit")] = None,
    strategy: Annotated[str, typer.Option("--strategy", help="auto, baseline, or one strategy "
                                          "(key or JSON) for every pair")] = "auto",
    memory: Annotated[str, typer.Option("--memory", help=MEMORY_HELP)] = "0.05",
    json_out: Annotated[bool, typer.Option("--json", help="one JSON object per pair on stdout")] = False,
    on: Annotated[str | None, typer.Option("--target", help="aot:tpu:TOPOLOGY: plan for that TPU slice "
                                           "with XLA:TPU's compiler (libtpu; nothing runs)")] = None,
) -> None:
    chosen = strategy_arg(strategy)
    bound = memory_arg(memory)
    aot = aot_target(on)
    prog = load_program(target, mesh=mesh, kwargs=kwargs, explicit=explicit,
                        devices=devices or (len(aot[1]) if aot and not mesh else None))
    import jax

    from autotuner.overlap import overlap
    from autotuner.program.factory import plan_notes, plan_rows

    fn, args, fkw, run_mesh, prefer = prog.fn, prog.args, prog.kwargs, prog.mesh, None
    if aot is not None:
        fn, args, fkw, run_mesh, prefer = relaid(prog.fn, prog.args, prog.kwargs, prog.mesh, *aot)
    with tempfile.TemporaryDirectory(prefix="autotuner-plan-") as tmp:
        winners = make_client(db=db, service=service, snapshot=snapshot, device=device,
                              n=mesh_size(prog), tmpdir=tmp, prefer=prefer.key if prefer else None)
        where = f" on {prefer.label}, {ESTIMATED_LABEL}" if prefer else ""
        err.print(f"planning {target}{where}; {winners.said(chosen)}", highlight=False)
        ov = overlap(fn, strategy=chosen, client=winners.client, memory=bound)
        if run_mesh is not None:
            with jax.set_mesh(run_mesh):
                plan = ov.plan(*args, **fkw)
        else:
            plan = ov.plan(*args, **fkw)
    rows, notes = plan_rows(plan), plan_notes(plan)
    if json_out:
        for row in rows:
            row.pop("strategy_dict")
            row.pop("problem")
            sys.stdout.write(json.dumps(row) + "\n")
        sys.stdout.flush()
        for t in notes[:2]:   # temp memory, preparation time
            err.print(t, highlight=False)
    else:
        print_plan(rows, notes)
    if not plan:
        err.print("no collective/einsum pair in this program: overlap(fn) is plain jax.jit", highlight=False)

"""`autotuner bench-model MODULE:FACTORY --target ...`: plain `jax.jit` against `overlap(fn)` on
one target, interleaved in one run: median and 95% interval per step, the speedup with its
interval, and the per-pair breakdown (each decomposed pair timed alone with the tuner's harness).
Flags a program whose overlapped step is slower than plain beyond the interval.
"""

from __future__ import annotations

import json
import sys
import tempfile
from typing import Annotated, Any

import typer

from autotuner.cli.common import app, err, fmt, say
from autotuner.cli.plan_cmd import print_plan, strategy_arg
from autotuner.program.factory import TOLERANCE_HELP
from autotuner.program.load import FACTORY_HELP, MEMORY_HELP
from autotuner.program.winners import SOURCE_HELP

HELP = f"""Benchmark a program's step: plain jax.jit against autotuner.overlap(fn), interleaved in one run (median and 95% interval per step, speedup with its interval), with the per-pair breakdown: every pair timed alone (baseline, its decomposition, the collective alone, the einsum alone).

{FACTORY_HELP} Example: autotuner bench-model autotuner.examples.transformer:train_step --target lab:shared:4:2gbit --db sqlite:///autotuner.db

With --db the result is also stored in that database (one row of model_benches; the dashboard's /models page shows it); --no-store keeps it out.

--target is inproc:N (N in-process CPU devices), lab:TOPOLOGY:N:RATE (N processes on emulated links; the factory runs in each) or local (this machine's accelerators). Winners come from --db/--service/--snapshot for the target's device (--device to pick another); --strategy forces one for every pair. The overlapped results are checked against plain jit's before timing."""


def _ms(x: float | None) -> str:
    return fmt(None if x is None else 1e3 * x, ".2f")


def print_report(res: Any, plan: list[dict[str, Any]], out: Any = None) -> None:
    out = out or sys.stdout
    p, o = res.plain, res.overlapped
    out.write(f"{'step':<12}{'median':>12}{'95% interval':>26}{'n':>5}\n")
    for name, s in (("plain", p), ("overlapped", o)):
        out.write(f"{name:<12}{_ms(s.median_s) + ' ms':>12}{'[' + _ms(s.lo_s) + ', ' + _ms(s.hi_s) + '] ms':>26}"
                  f"{s.n:>5}\n")
    out.write(f"speedup {res.speedup:.3f}x [{fmt(res.speedup_lo, '.3f')}, {fmt(res.speedup_hi, '.3f')}]"
              f" (plain / overlapped, 95% interval)\n")
    if res.pairs:
        out.write("pairs, each timed alone (ms per run; x = runs per step; baseline rows: not decomposed; "
                  "served rows: the dot reads another ring's kept gather, shared with that dot in plain jit too, so no saving of its own):\n")
        head = ("problem", "strategy", "x", "baseline", "decomposed", "ratio", "collective", "einsum",
                "saved/step")
        rows = [head] + [(t.key[:12], t.strategy, str(t.count), _ms(t.baseline_s), _ms(t.strategy_s),
                          fmt(t.ratio, ".2f"), _ms(t.comm_s), _ms(t.comp_s), _ms(t.saved_s))
                         for t in res.pairs]
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        for r in rows:
            out.write("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() + "\n")
        for t in res.pairs:
            if t.failed:
                out.write(f"  {t.key[:12]} {t.strategy}: {t.failed}\n")
        comm, dec, saved = res.comm_s, res.decomposed_comm_s, res.predicted_saved_s
        measured = p.median_s - o.median_s

        def share(x: float | None) -> str:
            return f" ({100 * x / p.median_s:.0f}% of the plain step)" if x is not None and p.median_s else ""

        out.write(f"collectives alone, all pairs: {_ms(comm)} ms per step{share(comm)}; of the decomposed "
                  f"pairs: {_ms(dec)} ms{share(dec)}\n")
        out.write(f"saving per step: predicted from the pairs alone {_ms(saved)} ms, measured "
                  f"{_ms(measured)} ms\n")
    if res.attribution is not None:
        print_attribution(res, out)
    if res.profile:
        print_profile(res.profile, out)
        share = res.overlap_share
        out.write("overlap explains " + (f"{100 * share:.0f}%" if share is not None else "- (no saving)")
                  + " of the step's saving (more time with collectives beside compute / time saved, "
                  "profile means)\n")
    if not any(r["applied"] for r in plan):
        out.write("no pair is decomposed: overlapped is plain jit (see the plan)\n")
    if res.slower:
        out.write("FLAG: overlapped is slower than plain beyond the interval\n")
    out.flush()


def print_profile(prof: dict[str, Any], out: Any) -> None:
    """Both programs' `StepProfile`s (ms per step, means): busy with collectives, compute, both
    at once, neither."""
    out.write("where the step's time goes (process 0; XLA's thunk timings, mean per step, ms; "
              "both: collectives beside compute; idle: neither):\n")
    head = ("program", "steps", "step", "collectives", "compute", "both", "idle", "by collective")
    rows = [head]
    for name in ("plain", "overlapped"):
        p = prof.get(name)
        if not p:
            continue
        by = ", ".join(f"{k} {v:.2f}" for k, v in p["by_collective"].items())
        rows.append((name, str(p["steps"]), f"{p['step_ms']:.2f}", f"{p['collective_ms']:.2f}",
                     f"{p['compute_ms']:.2f}", f"{p['overlap_ms']:.2f}", f"{p['idle_ms']:.2f}", by))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        out.write("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() + "\n")


def print_attribution(res: Any, out: Any) -> None:
    """Each decomposed problem's saving: timed alone (the pairs), alone in the step, and what
    removing it from the plan costs; their sums against the measured saving."""
    def ci(lo: float | None, hi: float | None) -> str:
        return f"[{_ms(lo)}, {_ms(hi)}]"

    out.write("attribution, ms saved per step (alone in the step: plain - only this problem decomposed; "
              "without: the plan without it - the plan; 95% intervals):\n")
    split = any(a.overlap_share is not None for a in res.attribution)   # profiled: each saving's split
    head = ("problem", "name", "x", "pairs alone", "alone in step", "interval", "without", "interval",
            *(("overlap share",) if split else ()))
    rows = [head] + [(a.key[:12], a.name[:40], str(a.count), _ms(a.isolated_saved_s), _ms(a.alone_saved_s),
                      ci(a.alone_lo_s, a.alone_hi_s), _ms(a.without_saved_s), ci(a.without_lo_s, a.without_hi_s),
                      *((fmt(a.overlap_share and 100 * a.overlap_share, ".0f") + ("%" if a.overlap_share is not None
                                                                                    else ""),) if split else ()))
                     for a in res.attribution]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        out.write("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() + "\n")
    iso = [a.isolated_saved_s for a in res.attribution if a.isolated_saved_s is not None]
    alone = sum(a.alone_saved_s for a in res.attribution)
    out.write(f"sums: pairs alone {_ms(sum(iso)) if iso else '-'} ms, alone in step "
              f"{_ms(alone)} ms, without "
              f"{_ms(sum(a.without_saved_s for a in res.attribution))} ms; measured saving "
              f"{_ms(res.measured_saved_s)} ms\n")
    inter = res.interaction_saved_s
    if inter is not None and len(res.attribution) > 1:
        out.write(f"interaction between problems ((without - alone) / 2, one term per pair of problems): "
                  f"{_ms(inter)} ms; alone + interaction {_ms(alone + inter)} ms against the measured "
                  f"{_ms(res.measured_saved_s)} ms\n")


@app.command("bench-model", help=HELP)
def bench_cmd(
    target: Annotated[str, typer.Argument(metavar="MODULE:FACTORY", help="a factory of (fn, args)")],
    on: Annotated[str, typer.Option("--target", help="inproc:N, lab:TOPOLOGY:N:RATE or local")] = "inproc:4",
    mesh: Annotated[str | None, typer.Option("--mesh", help='mesh axes, e.g. \'{"model": 4}\'')] = None,
    kwargs: Annotated[str | None, typer.Option("--kwargs", help="JSON object of keyword arguments "
                                               "for the factory")] = None,
    explicit: Annotated[bool, typer.Option("--explicit/--auto", help="axis types of the --mesh: Auto (the default, as for extract) or Explicit")] = False,
    db: Annotated[str | None, typer.Option("--db", help=SOURCE_HELP)] = None,
    service: Annotated[str | None, typer.Option("--service", help="service URL to read winners from")] = None,
    snapshot: Annotated[str | None, typer.Option("--snapshot", help="snapshot file of winners")] = None,
    device: Annotated[str | None, typer.Option("--device", help="whose winners (default: the target's)")] = None,
    strategy: Annotated[str, typer.Option("--strategy", help="auto, baseline, or one strategy "
                                          "(key or JSON) for every pair")] = "auto",
    memory: Annotated[str, typer.Option("--memory", help=MEMORY_HELP)] = "0.05",
    reps: Annotated[int, typer.Option(min=5, help="timed steps of each program")] = 20,
    warmup: Annotated[int, typer.Option(min=1, help="untimed steps of each program first")] = 2,
    pairs: Annotated[bool, typer.Option("--pairs/--no-pairs", help="time each decomposed pair alone")] = True,
    pair_reps: Annotated[int, typer.Option(min=3, help="repetitions per pair alone")] = 7,
    attribute: Annotated[bool, typer.Option("--attribute", help="also time, interleaved with plain and the "
                                            "plan, the step with each decomposed problem alone and the plan "
                                            "without it: each problem's saving in the program")] = False,
    tolerance: Annotated[float | None, typer.Option("--tolerance", min=0.0, help=TOLERANCE_HELP)] = None,
    profile: Annotated[int, typer.Option("--profile", min=0, help="also run N steps of each program under "
                                         "jax.profiler with XLA's thunk timings: where the step's time goes "
                                         "(collectives, compute, both, idle; process 0)")] = 0,
    json_out: Annotated[bool, typer.Option("--json", help="the result as one JSON object on stdout")] = False,
    store: Annotated[bool, typer.Option("--store/--no-store", help="store the result in the --db database "
                                        "(default with --db)")] = True,
) -> None:
    from autotuner.program.on_target import open_program, target_args

    chosen = strategy_arg(strategy)
    tgt, shape, fkw, bound = target_args(on, mesh, kwargs, memory)
    sources = dict(db=db, service=service, snapshot=snapshot, device=device)
    with tempfile.TemporaryDirectory(prefix="autotuner-bench-") as tmp, \
            open_program(tgt, target, fkw, shape, explicit, chosen, sources, tmp, memory=bound,
                         attribute=attribute) as prog:
        res = _bench(prog, reps=reps, warmup=warmup, pairs=pairs, pair_reps=pair_reps, attribute=attribute,
                     profile=profile, tolerance=tolerance, log=say)
    plan, notes, error, dev = prog.rows, prog.notes, prog.error, prog.device
    stored: dict[str, Any] = {}
    if db and store:
        from autotuner.program.bench_store import bench_values, store_bench

        values = bench_values(res, program=target, kwargs=fkw, target=on, mesh=shape,
                              strategy=chosen if isinstance(chosen, str) else chosen.key, rel_error=error)
        stored["bench_id"] = store_bench(db, dev, values)
        err.print(f"stored as bench-model run {stored['bench_id']} (dashboard: /models/"
                  f"{stored['bench_id']})", highlight=False)
    if json_out:
        sys.stdout.write(json.dumps({"target": on, "program": target, "error": error, "plan": plan,
                                     "notes": notes, **res.to_dict(), **stored}, default=str) + "\n")
        sys.stdout.flush()
    else:
        print_plan(plan, notes)
        print_report(res, plan)


def _bench(prog: Any, *, reps: int, warmup: int, pairs: bool, pair_reps: int, attribute: bool, profile: int,
           tolerance: float | None, log: Any) -> Any:
    """The opened program (`on_target.Opened`) checked and timed: plain and the plan interleaved,
    then as asked each decomposed pair alone, the attribution's variants, the profile."""
    from dataclasses import replace

    from autotuner.measure.steps import attribute as attribution
    from autotuner.measure.steps import compare, decomposed_units, overlap_share, pair_breakdown
    from autotuner.program.factory import check_numerics

    check_numerics(prog.rows, prog.error, tolerance)
    log(f"numerics: overlapped = plain jit within {prog.error:.2g} (relative); timing {reps} steps each")
    plain, ov, *variants = prog.time(reps, warmup)
    res = compare(plain, ov, reps)
    if pairs:
        res.pairs = pair_breakdown(prog.plan, prog.runner_for, reps=pair_reps, log=log)
    if profile:
        res.profile = prog.profile(profile)
    if attribute:
        res.attribution = attribution(decomposed_units(prog.plan), plain, ov, variants[0::2], variants[1::2],
                                      res.pairs)
        alone = (res.profile or {}).get("alone") or [None] * len(res.attribution)   # each problem's split
        res.attribution = [replace(row, overlap_share=overlap_share((res.profile or {}).get("plain"), prof))
                           for row, prof in zip(res.attribution, alone, strict=True)]
    return res

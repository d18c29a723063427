"""`autotuner tune-model MODULE:FACTORY --target ... --db ...`: extract -> tune (the isolated
search, as `extract` and `tune` do it, each a subprocess of this CLI) -> refinement in the
program (`autotuner.tune.refine`): per problem, the candidates the isolated ranking put close to
the winner, and baseline, tried in the whole step on the same target, interleaved; a change kept
only where the step's interval says it is faster; each result stored as in-program evidence for
(device, program, problem), which `overlap`/`plan` prefer for the same program. A killed run
resumes: problems with stored evidence for this program are not timed again.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from typing import Annotated, Any

import typer

from autotuner.cli.common import DB_HELP, app, db_url, err, fail, open_database, say
from autotuner.program.factory import TOLERANCE_HELP
from autotuner.program.load import FACTORY_HELP, MEMORY_HELP

HELP = f"""Tune a program's problems and refine the choices in the program itself: extract -> tune (each problem alone) -> refinement (per problem, the candidates close to its isolated winner and baseline, timed in the whole step, interleaved; a change kept only when the step's 95% interval says it is faster). The results are stored in --db as in-program evidence, which autotuner.overlap and `plan` prefer for the same program. Rerun to resume: problems already refined for this program are not timed again.

{FACTORY_HELP} Example: autotuner tune-model autotuner.examples.transformer:train_step --explicit --mesh '{{"model": 2}}' --target lab:shared:2:2gbit --db sqlite:///autotuner.db"""


class Rig:
    """The opened program (`on_target.Opened`) as `refine` times it: plain, the isolated plan, the
    variants; each set of variants checked against plain jit before it is timed."""

    def __init__(self, prog: Any, memory: float | None, tol: float, warmup: int) -> None:
        self.prog, self.memory, self.tol, self.warmup = prog, memory, tol, warmup

    def variants(self, choices: list[dict[str, Any]]) -> list[set[str]]:
        from autotuner.program.factory import check_numerics

        applied, error = self.prog.set_variants(choices, self.memory)
        check_numerics([], error, self.tol, "a refinement variant")
        return applied

    def time(self, reps: int) -> list[list[float]]:
        return self.prog.time(reps, self.warmup)


def units_of(plan_rows: list[dict[str, Any]], current: dict[str, Any], candidates: Any) -> list[Any]:
    """Every problem of the plan once (all its occurrences together), in program order, with the
    candidates `candidates(problem_key, current_strategy)` gives."""
    from autotuner.strategy import Strategy
    from autotuner.tune.refine import RefineUnit

    seen: dict[str, list[Any]] = {}
    for r in plan_rows:
        if r["problem"] is None:
            continue
        u = seen.setdefault(r["key"], [r["name"], 0])
        u[1] += 0 if r["member"] else r["count"]
    return [RefineUnit(k, name, count, tuple(candidates(k, current.get(k, Strategy.baseline()))))
            for k, (name, count) in seen.items()]


@app.command("tune-model", help=HELP)
def tune_model_cmd(
    target: Annotated[str, typer.Argument(metavar="MODULE:FACTORY", help="a factory of (fn, args)")],
    on: Annotated[str, typer.Option("--target", help="inproc:N, lab:TOPOLOGY:N:RATE, local, or aot:tpu:TOPOLOGY "
                                    "(the isolated search only: estimates, no step to time)")] = "inproc:4",
    db: Annotated[str | None, typer.Option("--db", help=DB_HELP + ": winners, measurements, evidence")] = None,
    mesh: Annotated[str | None, typer.Option("--mesh", help='mesh axes, e.g. \'{"model": 2}\'')] = None,
    kwargs: Annotated[str | None, typer.Option("--kwargs", help="JSON object of keyword arguments for the factory")] = None,
    explicit: Annotated[bool, typer.Option("--explicit/--auto", help="axis types of the --mesh")] = False,
    trials: Annotated[int, typer.Option(min=1, help="isolated search: trials per problem")] = 6,
    tune_reps: Annotated[int, typer.Option(min=3, help="isolated search: repetitions per trial")] = 5,
    skip_tune: Annotated[bool, typer.Option("--skip-tune", help="refine the winners --db already holds")] = False,
    reps: Annotated[int, typer.Option(min=5, help="refinement: interleaved steps per program")] = 15,
    candidates: Annotated[int, typer.Option(min=0, max=8, help="refinement: strategies tried per problem "
                                            "besides baseline (closest to the isolated winner first)")] = 2,
    memory: Annotated[str, typer.Option("--memory", help=MEMORY_HELP)] = "0.05",
    tolerance: Annotated[float | None, typer.Option("--tolerance", min=0.0, help=TOLERANCE_HELP)] = None,
    json_out: Annotated[bool, typer.Option("--json", help="the result as one JSON object on stdout")] = False,
) -> None:
    from autotuner.program.on_target import target_args

    tgt, shape, fkw, bound = target_args(on, mesh, kwargs, memory)
    url = db_url(db)
    open_database(url).engine.dispose()   # created and migrated here, once
    common = [*(["--mesh", json.dumps(shape)] if shape else []), "--kwargs", json.dumps(fkw),
              "--explicit" if explicit else "--auto"]
    aot = tgt.estimates   # a compile-only target: the isolated search only, nothing to time in the step
    with tempfile.TemporaryDirectory(prefix="autotuner-tune-model-") as tmp:
        if not skip_tune:
            problems = f"{tmp}/problems.json"
            for argv in (["extract", target, *common, *(["--target", on] if aot else []), "-q", "-o", problems],
                         ["tune", "--problems", problems, "--target", on, "--db", url, "--trials", str(trials),
                          "--reps", str(tune_reps)]):
                err.print(f"$ autotuner {' '.join(argv)}", highlight=False)
                if subprocess.run([sys.executable, "-m", "autotuner.cli", *argv], stdout=sys.stderr).returncode:
                    fail(f"autotuner {argv[0]} failed; nothing was refined")
                if argv[0] == "extract":
                    _same_devices(problems, tgt)
        if aot:
            say(f"{on} compiles and estimates, it runs nothing: the refinement in the program (timed whole "
                f"steps) is left out. The estimated winners are in {url}; `autotuner plan {target} --target {on} "
                f"--db {url}` shows the plan they make.")
            if json_out:
                sys.stdout.write(json.dumps({"program": target, "kwargs": fkw, "target": on, "refined": False,
                                             "estimated": True}) + "\n")
            return
        result = _refine(tgt, target, fkw, shape, explicit, url, tmp, reps=reps, k=candidates, memory=bound,
                         tolerance=tolerance)
    if json_out:
        sys.stdout.write(json.dumps(result, default=str) + "\n")
    else:
        _print(result)


def _same_devices(problems: str, tgt: Any) -> None:
    """The extracted problems' mesh against the target's devices, before anything is tuned: a
    target of another size fails every problem, one line each."""
    from autotuner.measure.targets import TargetError, check_fits
    from autotuner.problem.problems_file import load_problems

    try:
        check_fits(load_problems(problems), tgt)
    except TargetError as e:
        fail(f"{e}, or a --mesh of {tgt.n}")


def _refine(tgt: Any, target: str, fkw: dict[str, Any], shape: Any, explicit: bool, url: str, tmp: str, *,
            reps: int, k: int, memory: float | None, tolerance: float | None) -> dict[str, Any]:
    from autotuner.measure.stats import ratio_ci
    from autotuner.program.factory import check_numerics
    from autotuner.program.on_target import open_program
    from autotuner.snapshot import device_values
    from autotuner.strategy import Strategy
    from autotuner.tune.refine import close_candidates, refine
    from db import repository as repo

    def same_device(winners: Any, dev: Any) -> None:
        if winners.device is not None and winners.device.key != dev.key:
            fail(f"--db holds winners for {winners.device.label}, not for the target's device {dev.label}: "
                 "tune on this target first (leave out --skip-tune)")

    sources = dict(db=url, service=None, snapshot=None, device=None)
    with open_program(tgt, target, fkw, shape, explicit, "auto", sources, tmp, memory=memory, verb="refining",
                      check=same_device) as prog:
        tol = check_numerics(prog.rows, prog.error, tolerance)
        if not prog.program:
            fail(f"{target} has no decomposable pair: nothing to refine")
        program, dev, rig = prog.program, prog.device, Rig(prog, memory, tol, 2)
        current = {r["key"]: Strategy.from_dict(r["strategy_dict"]) for r in prog.rows
                   if r["problem"] is not None and r["applied"]}
        label = f"{target} {json.dumps(fkw, sort_keys=True)}"[:1024]
        database = open_database(url)
        try:
            with database.session() as s:
                dev_row = repo.upsert_device(s, **device_values(dev))
                stored = {e.problem_key: _evidence(e) for e in repo.get_evidence(s, dev.key, program)}

            def cands(key: str, cur: Any) -> list[Any]:
                with database.session(read_only=True) as s:
                    p = repo.get_problem_by_key(s, key)
                    ms = repo.list_measurements(s, p.id, dev_row.id) if p is not None else []
                return list(close_candidates(ms, cur, k))

            units = units_of(prog.rows, current, cands)
            say(f"program {program}: {len(units)} problem(s), {len(stored)} with stored evidence; "
                f"{reps} interleaved steps per program")

            def store(ev: Any) -> None:
                with database.session() as s:
                    repo.record_evidence(s, dev_row.id, program_key=program, program=label, problem_key=ev.problem_key,
                                         name=next(u.name for u in units if u.key == ev.problem_key)[:512],
                                         strategy=ev.strategy.to_dict(), strategy_key=ev.strategy.key,
                                         previous=ev.previous.to_dict(), previous_key=ev.previous.key,
                                         speedup=ev.speedup, speedup_lo=ev.speedup_lo, speedup_hi=ev.speedup_hi,
                                         reps=ev.reps, tried=list(ev.tried))

            final, evidence = refine(rig, units, current, reps=reps, stored=stored, store=store, log=say)
        finally:
            database.engine.dispose()
        # before / after, interleaved: plain, the isolated plan, the refined plan
        rig.variants([final])
        plain, isolated, refined = rig.time(reps)
    iso, ref, gain = ratio_ci(plain, isolated), ratio_ci(plain, refined), ratio_ci(isolated, refined)
    return {"program": target, "kwargs": fkw, "target": tgt.text, "device": dev.to_dict(), "device_key": dev.key,
            "program_key": program,
            "units": [{"key": u.key, "name": u.name, "count": u.count,
                       "candidates": [c.key for c in u.candidates]} for u in units],
            "evidence": [{"problem_key": e.problem_key, "strategy": e.strategy.key, "previous": e.previous.key,
                          "changed": e.changed, "speedup": e.speedup, "speedup_lo": e.speedup_lo,
                          "speedup_hi": e.speedup_hi, "reps": e.reps, "tried": list(e.tried)} for e in evidence],
            "isolated_speedup": list(iso), "refined_speedup": list(ref), "refined_over_isolated": list(gain),
            "reps": reps}


def _evidence(rec: Any) -> Any:
    from autotuner.strategy import Strategy
    from autotuner.tune.refine import Evidence

    return Evidence(rec.problem_key, Strategy.from_dict(rec.strategy), Strategy.from_dict(rec.previous),
                    rec.speedup, rec.speedup_lo, rec.speedup_hi, rec.reps, tuple(rec.tried))


def _print(r: dict[str, Any]) -> None:
    out = sys.stdout
    names = {u["key"]: u["name"] for u in r["units"]}
    out.write(f"program {r['program_key']} on {r['target']}: in-program evidence per problem\n")
    for e in r["evidence"]:
        sp = (f"step {e['speedup']:.3f}x [{e['speedup_lo'] or float('nan'):.3f}, "
              f"{e['speedup_hi'] or float('nan'):.3f}] with the best candidate" if e["speedup"] else "nothing to try")
        what = f"changed {e['previous']} -> {e['strategy']}" if e["changed"] else f"kept {e['strategy']}"
        out.write(f"  {names.get(e['problem_key'], e['problem_key'][:12])}: {what}; {sp}\n")

    def ci(x: list[float]) -> str:
        return f"{x[0]:.3f}x [{x[1]:.3f}, {x[2]:.3f}]"

    out.write(f"step speedup over plain jit ({r['reps']} interleaved steps each): isolated plan "
              f"{ci(r['isolated_speedup'])}, refined plan {ci(r['refined_speedup'])}; refined over isolated "
              f"{ci(r['refined_over_isolated'])}\n")
    out.flush()

"""`autotuner tune`: measure problems on a target, store the results (a database, or a service's
through its outbox). Progress and tables go to stderr, JSON to stdout."""

from __future__ import annotations

import json
import sys
import time
import uuid
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.table import Table

from autotuner.cli.common import (
    DB_HELP,
    SERVICE_TOKEN_ENV,
    TOKEN_FILE_HELP,
    app,
    check_service_url,
    db_url,
    err,
    fail,
    fmt,
    open_database,
    say,
    token_of,
)
from autotuner.device import ESTIMATED_LABEL


def load_items(problems: str | None, n: int, scale: float) -> list[tuple[str, Any]]:
    """(name, Problem) per problem: the suite's names, the names `autotuner extract` wrote into the
    file (its "names" list), else FILE[i]."""
    from autotuner.problem.problems_file import ProblemsFileError, load_problems
    from autotuner.problem.suite import suite

    if problems is None or problems == "suite":
        return [(name, p) for name, _regime, p in suite(n, scale=scale)]
    try:
        loaded = load_problems(problems)
    except ProblemsFileError as e:
        fail(str(e))
        raise AssertionError from e
    names = file_names(problems, len(loaded))
    return [(names[i] or f"{Path(problems).name}[{i}]", p) for i, p in enumerate(loaded)]


def file_names(path: str, n: int) -> list[str | None]:
    """The "names" list of an extracted problems file (JSON object), one per problem, else Nones."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return [None] * n
    names = doc.get("names") if isinstance(doc, dict) else None
    if not isinstance(names, list) or len(names) != n:
        return [None] * n
    return [x if isinstance(x, str) and x else None for x in names]


INPROC_CPU_WARNING = (
    "warning: inproc on CPU: the devices are threads of this one process sharing its cores, and their "
    "collectives are memory copies, so these timings say nothing of a real interconnect (correctness and "
    "plumbing only); for measured winners use --target lab:shared:N:RATE (real processes over shaped links), "
    "local on a GPU/TPU host, or aot:tpu:TOPOLOGY for XLA:TPU's estimates")


@app.command()
def tune(
    ctx: typer.Context,
    problems: Annotated[str | None, typer.Option("--problems", help="JSON, JSONL or YAML file of Problems, "
                                                 "or 'suite' for the built-in transformer suite")] = None,
    target: Annotated[str | None, typer.Option(help="inproc:N, lab:TOPOLOGY:N:RATE, local, or aot:tpu:TOPOLOGY "
                                               "(XLA:TPU compile, estimated times); default: local on a GPU/TPU "
                                               "host, else inproc with the problems' device count")] = None,
    db: Annotated[str | None, typer.Option("--db", help=DB_HELP)] = None,
    service: Annotated[str | None, typer.Option(help="upload results to this service URL instead")] = None,
    token: Annotated[str | None, typer.Option(envvar=SERVICE_TOKEN_ENV, help="write token for --service "
                                              "(better: the environment variable, or --token-file)")] = None,
    token_file: Annotated[Path | None, typer.Option(help=TOKEN_FILE_HELP)] = None,
    trials: Annotated[int, typer.Option(min=1, help="trial budget per problem (search)")] = 24,
    seconds: Annotated[float | None, typer.Option(min=1, help="time budget per problem (search)")] = None,
    exhaustive: Annotated[bool, typer.Option(help="measure every strategy of the space")] = False,
    reps: Annotated[int, typer.Option(min=3, help="timed repetitions per strategy")] = 7,
    precision: Annotated[float, typer.Option(min=0.0, max=0.5, help="then repeat until the leader's speedup "
                                             "CI is within +/- this fraction (0: exactly --reps)")] = 0.05,
    precision_seconds: Annotated[float, typer.Option(min=0.0, help="time budget of those extra "
                                                     "repetitions, per session")] = 60.0,
    aa: Annotated[bool, typer.Option(help="time the baseline twice (A/A) in every session: the "
                                     "noise floor, reported as 'A/A +/-'")] = True,
    scale: Annotated[float, typer.Option(min=0.01, max=4.0, help="size factor for the built-in suite")] = 1.0,
    json_out: Annotated[bool, typer.Option("--json", help="one JSON object per problem on stdout")] = False,
    coordinator: Annotated[str | None, typer.Option(help="multi-process --target local: process 0's "
                                                    "HOST:PORT (default JAX_COORDINATOR_ADDRESS when "
                                                    "JAX_NUM_PROCESSES > 1)")] = None,
    num_processes: Annotated[int | None, typer.Option(min=1, help="multi-process --target local: how many "
                                                      "processes (the same command on each host)")] = None,
    process_id: Annotated[int | None, typer.Option(min=0, help="multi-process --target local: this "
                                                   "process's id; 0 leads and stores")] = None,
) -> None:
    """Tune problems on a target and store the measurements and winners.

    Multi-process `local` (a JAX multi-host job): start the same command once per host with
    --coordinator/--num-processes/--process-id (or under `autotuner lab run`, which sets the
    JAX_* variables); process 0 searches and stores, the others measure in lockstep with it."""
    from autotuner.measure import Precision
    from autotuner.measure.multiprocess import MultiProcessError, follow, job_from, join
    from autotuner.measure.targets import (
        Target,
        TargetError,
        TargetSession,
        default_target,
        mesh_devices,
    )

    try:
        job = job_from(coordinator, num_processes, process_id)
    except MultiProcessError as e:
        fail(str(e))
    # a file is read (and refused) before a target starts; without --target its meshes say how many
    # in-process devices a CPU host gives them (the suite's mesh is the target's size)
    items = load_items(problems, 0, scale) if problems not in (None, "suite") and not job else None
    try:
        tgt = Target.parse(target or ("local" if job else default_target(mesh_devices([p for _, p in items or []]))))
    except TargetError as e:
        fail(str(e))
    mp_ctx = None
    if job is not None:
        if tgt.kind != "local":
            fail(f"a multi-process run measures on --target local, not {tgt.text}")
        try:
            mp_ctx = join(job)
        except Exception as e:  # noqa: BLE001 - jax raises its runtime errors
            fail(f"process {job.process_id} of {job.num_processes} could not join {job.coordinator}: "
                 f"{first_line(str(e) or type(e).__name__)}")
        if job.process_id != 0:  # a follower: measures what process 0 asks, stores nothing
            try:
                follow(mp_ctx)
            except MultiProcessError as e:
                fail(str(e), code=1)
            return
    if items is None and (tgt.n or problems not in (None, "suite")):
        items = load_items(problems, tgt.n or 0, scale)
    token = token_of(ctx, token, token_file)
    if service and not token:
        fail(f"--service needs a write token of the service: set {SERVICE_TOKEN_ENV}, or give --token-file "
             "FILE (or --token)")
    if service and db:
        fail("give either --db (store locally) or --service (upload), not both")
    if service:
        check_service_url(service)
        from autotuner.tune.service_worker import scratch_db_url

        database = open_database(scratch_db_url(service))  # the study and measurements, then uploaded
        send_left(service, token)
    else:
        database = open_database(db_url(db))
    if not exhaustive:
        try:
            from autotuner.tune import search  # noqa: F401
        except ImportError:
            fail("the Optuna search is not available yet; run with --exhaustive")
    run_id = uuid.uuid4().hex[:12]
    rows: list[dict[str, Any]] = []
    interrupted = False
    try:
        with TargetSession(tgt, log=say, ctx=mp_ctx) as ts:
            items = items if items is not None else load_items(problems, ts.num_devices, scale)
            err.print(f"target {tgt.text}: {len(items)} problem(s), run {run_id}", highlight=False)
            err.print(f"device {ts.device.label} ({ts.device.key[:8]})", highlight=False)
            if tgt.kind == "inproc" and ts.device.platform == "cpu":
                err.print(INPROC_CPU_WARNING, highlight=False)
            if ts.estimates:
                err.print(ESTIMATED + ": every candidate is compiled for the target, nothing runs; "
                          "--reps, --precision and --aa do not apply", highlight=False)
                reps, aa, precision = 1, False, 0.0   # measure.aot.ESTIMATE_SESSION
            elif not exhaustive:
                say_model(database, ts.device)
            try:
                for name, problem in items:
                    row = tune_or_fail(ts, database, name, problem, run_id, exhaustive=exhaustive, trials=trials,
                                       seconds=seconds, reps=reps, aa=aa,
                                       precision=Precision(target=precision, seconds=precision_seconds))
                    if service and row["error"] is None:
                        mine = (row["winner"], row["speedup"])
                        row.update(upload_run(service, token, ts.device, problem, database, run_id, name=name))
                        if (row["winner"], row["speedup"]) != mine:   # the service's winner: not this split's
                            from autotuner.measure.session import NO_SPLIT

                            row.update(NO_SPLIT)
                    rows.append(row)
                    if json_out:
                        sys.stdout.write(json.dumps(row) + "\n")
                        sys.stdout.flush()
            except KeyboardInterrupt:   # Ctrl-C: what is done is summarised, the target closed as ever
                interrupted = True
    except TargetError as e:
        fail(str(e))
    if interrupted:
        stop_interrupted(rows, len(items or []))
    print_summary(rows)
    for r in rows:
        if r.get("candidates"):
            print_candidates(r)
    line = summary_line(rows)
    failed = [r for r in rows if r["error"] is not None]
    err.print(line, highlight=False, style="bold red" if failed else None)
    if failed:
        raise typer.Exit(1)


def stop_interrupted(rows: list[dict[str, Any]], total: int) -> NoReturn:
    """Ctrl-C: the problems done summarised, and where the run stopped; exit 130 (the shell's)."""
    print_summary(rows)
    err.print(f"interrupted after {len(rows)} of {total} problem(s), which are stored (the one being tuned was "
              "not finished)", highlight=False, style="bold red")
    raise typer.Exit(130)


def first_line(text: str, limit: int = 300) -> str:
    line = next((x.strip() for x in str(text).splitlines() if x.strip()), "") or "failed"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def summary_line(rows: list[dict[str, Any]]) -> str:
    """`12 tuned, 1 failed: <name>: <reason>` (every failure, separated by '; ')."""
    failed = [r for r in rows if r["error"] is not None]
    line = f"{len(rows) - len(failed)} tuned, {len(failed)} failed"
    if failed:
        line += ": " + "; ".join(f"{r['name']}: {first_line(r['error'])}" for r in failed)
    return line


def tune_or_fail(ts: Any, database: Any, name: str, problem: Any, run_id: str, **kw: Any) -> dict[str, Any]:
    """Tune one problem; a problem that raises, or whose every candidate (the baseline too) failed,
    is recorded in the database as failed (with its error) and the batch goes on."""
    from autotuner.measure.targets import TargetError

    t0 = time.perf_counter()
    try:
        ts.check(problem)
        row = tune_one(ts, database, name, problem, run_id, **kw)
    except TargetError as e:   # this target cannot run it (e.g. a mesh of another size)
        error = str(e)
        err.print(f"[bold red]{name}: failed:[/] {error}", highlight=False)
        row = failed_row(ts, name, problem, error, t0)
    except Exception as e:  # noqa: BLE001 - one problem's failure must not stop the batch
        error = f"{type(e).__name__}: {e}"
        err.print(f"[bold red]{name}: failed:[/] {first_line(error)}", highlight=False)
        row = failed_row(ts, name, problem, error, t0)
    if row["error"] is not None:
        from autotuner.tune import store

        try:
            store.save_failure(database, ts.device, problem, name=name, error=row["error"], run_id=run_id)
        except Exception as e:  # noqa: BLE001 - say so, keep going
            err.print(f"{name}: could not record the failure: {type(e).__name__}: {e}", highlight=False)
    return row


def failed_row(ts: Any, name: str, problem: Any, error: str, t0: float) -> dict[str, Any]:
    from autotuner.measure.session import NO_SPLIT

    return {"key": problem.key, "name": name, "problem": problem.to_dict(), "device": ts.device.to_dict(),
            "winner": None, "speedup": None, "speedup_ci": None, "baseline_s": None, "winner_s": None,
            "bound_s": None, "efficiency": None, "aa_width": None, "aa_ci": None, "trials": 0,
            "seconds": round(time.perf_counter() - t0, 3),
            "failed": None, "error": error[:2000], "estimated": ts.device.estimated, "reference": None,
            **NO_SPLIT, "unresolved": None, "candidates": []}


def say_model(database: Any, device: Any) -> None:
    from autotuner.costmodel import CostModelError, load_params

    try:
        load_params(database, device)
    except CostModelError:
        err.print("cost model: this device has no calibration (`autotuner calibrate`); "
                  "the search starts from the nearest tuned shapes only", highlight=False)
    else:
        err.print("cost model: the device's calibration orders the first trials", highlight=False)


def tune_one(ts: Any, database: Any, name: str, problem: Any, run_id: str, *, exhaustive: bool,
              trials: int, seconds: float | None, reps: int, aa: bool = True,
              precision: Any = None) -> dict[str, Any]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from autotuner.decompose.space import space
    from autotuner.measure import run_session
    from autotuner.strategy import reference
    from autotuner.tune import store

    t0 = time.perf_counter()
    strategies = space(problem, ts.device)
    if exhaustive:   # each ring beside its serial control, which splits its speedup (traffic x overlap)
        strategies += [s.serial() for s in strategies if s.method == "ring"]
    ref = reference(ts.device.platform)
    err.print(f"[bold]{name}[/]: {problem.describe()} — {len(strategies)} strategies", highlight=False)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True) as prog:
        if exhaustive:
            task = prog.add_task(f"{name}: compiling {len(strategies)}", total=reps)
            session = run_session(ts.runner(problem), problem, strategies, reps=reps,
                                  log=say, aa=aa, precision=precision, reference=ref,
                                  on_rep=lambda r, n: prog.update(task, completed=r, total=n,
                                                                  description=f"{name}: timing"))
            winner = store.save(database, ts.device, problem, store.session_items(session, run_id),
                                name=name)
            n_trials, failed = len(strategies), sum(c.status != "ok" for c in session.candidates)
            bound_s = session.bound_s
            aa_w = session.aa_width
            aa_ci = [session.aa.ratio_lo, session.aa.ratio_hi] if session.aa is not None else None
            seen = [session.baseline, *session.candidates]
        else:
            from autotuner.tune.search import tune_problem

            result = tune_problem(ts, database, problem, trials=trials, seconds=seconds, reps=reps,
                                  run_id=run_id, progress=prog, name=name, aa=aa, precision=precision)
            winner, n_trials, failed, bound_s = result.winner, result.trials, result.failed, result.bound_s
            aa_w, aa_ci = result.aa_width, list(result.aa_ci) if result.aa_ci else None
            seen = result.candidates
    from autotuner.measure.session import controls_of

    controls = controls_of(seen)
    # a worker that found every trial of the budget claimed by the study's other workers measured
    # nothing itself: not a failure (their winner is stored when they finish)
    by_others = not exhaustive and n_trials == 0 and result.studied > 0
    error = None if winner is not None or by_others else store.why_no_winner(database, ts.device, problem)
    eff = None
    if winner is not None and bound_s and winner.baseline_s and winner.winner_s:
        from autotuner.measure import efficiency

        eff = efficiency(winner.baseline_s, winner.winner_s, bound_s)
    return {"key": problem.key, "name": name, "problem": problem.to_dict(), "device": ts.device.to_dict(),
            "winner": winner.strategy if winner else None,
            "speedup": winner.speedup if winner else None,
            "speedup_ci": [winner.speedup_lo, winner.speedup_hi] if winner else None,
            "baseline_s": winner.baseline_s if winner else None,
            "winner_s": winner.winner_s if winner else None,
            "bound_s": bound_s, "efficiency": eff, "aa_width": aa_w, "aa_ci": aa_ci, "trials": n_trials,
            "seconds": round(time.perf_counter() - t0, 3), "failed": failed, "error": error,
            "estimated": ts.device.estimated, "reference": ref.key,
            "unresolved": store.why_unresolved(database, ts.device, problem) if winner is not None else None,
            **winner_split(winner),
            "candidates": [candidate_row(c, ts.device.estimated, controls) for c in seen]}


def winner_split(winner: Any) -> dict[str, Any]:
    """The winner's `serial_s`, `traffic_speedup`, `overlap_speedup`: its winning measurement's
    split by its serial control, stored with it from the same session (None each without one)."""
    from autotuner.measure.session import NO_SPLIT

    if winner is None:
        return dict(NO_SPLIT)
    return {"serial_s": winner.serial_s, "traffic_speedup": winner.traffic_speedup,
            "overlap_speedup": winner.overlap_speedup}


ESTIMATED = ESTIMATED_LABEL


def candidate_row(c: Any, estimated: bool, controls: dict[int, Any] | None = None) -> dict[str, Any]:
    """One strategy of a problem as `tune --json` lists it beside the others: compiled or why,
    its memory on the target, its time (measured, or estimated on an `aot` target) and speedup
    over the reference, the split of a ring's speedup by its serial control where `controls` has
    it (`measure.split`), and on `aot` what the schedule overlaps."""
    from autotuner.measure.session import split

    mem, sched = c.memory or {}, c.schedule or {}
    return {"strategy": c.strategy, "key": c.key, "compiled": c.compile_s is not None, "status": c.status,
            "reason": c.reason, "temp_bytes": mem.get("temp_size_in_bytes"),
            "argument_bytes": mem.get("argument_size_in_bytes"),
            "median_s": None if estimated else c.median_s, "estimated_s": c.median_s if estimated else None,
            "speedup": c.ratio, "speedup_ci": None if estimated else [c.ratio_lo, c.ratio_hi],
            "async_collectives": sched.get("async_collectives"),
            "overlapped_collectives": sched.get("overlapped_collectives"),
            "collective_s": sched.get("collective_s"), "exposed_s": sched.get("exposed_s"),
            "compute_s": sched.get("compute_s"), "hidden_fraction": sched.get("hidden_fraction"),
            **split(c, (controls or {}).get(id(c)))}


def print_candidates(row: dict[str, Any], rings: int = 3) -> None:
    """The reference, plain, xla_windowed, the baseline and the best few rings of one problem
    (each strategy's latest timing), a ring's speedup split by its serial control where timed."""
    cands = list({c["key"]: c for c in row["candidates"]}.values())
    est = row.get("estimated")
    t = Table(title=f"{row['name']}: candidates" + (f" — {ESTIMATED}" if est else ""), show_lines=False)
    for col in ("strategy", "compiled", "estimated ms" if est else "median ms", f"x {row['reference']}",
                "x traffic", "x overlap", "temp MB", "async", "overlapped", "hidden"):
        t.add_column(col)
    ok = sorted((c for c in cands if c["status"] == "ok" and c["key"].startswith("ring")),
                key=lambda c: c["estimated_s"] if est else c["median_s"])
    shown = [c for c in cands if not c["key"].startswith(("ring", "serial"))] + ok[:rings]
    shown += [c for c in cands if c["status"] != "ok" and c not in shown][:rings]
    for c in shown:
        secs = c["estimated_s"] if est else c["median_s"]
        hid = c["hidden_fraction"]
        t.add_row(c["key"], "yes" if c["compiled"] else "no: " + (c["reason"] or "")[:60],
                  fmt(secs and secs * 1e3, ".3f"), fmt(c["speedup"], ".3f"),
                  fmt(c["traffic_speedup"], ".3f"), fmt(c["overlap_speedup"], ".3f"),
                  fmt(c["temp_bytes"] and c["temp_bytes"] / 1e6, ".1f"), fmt(c["async_collectives"], "d"),
                  fmt(c["overlapped_collectives"], "d"), "-" if hid is None else f"{hid * 100:.0f}%")
    err.print(t)


def upload_run(service: str, token: str | None, device: Any, problem: Any, database: Any, run_id: str,
               name: str | None = None) -> dict[str, Any]:
    """Send this run's measurements to the service (kept in its outbox until stored); its winner
    replaces the local one."""
    import httpx

    from autotuner.errors import ServiceError
    from autotuner.tune import service_worker as sw

    try:
        with sw.http_client(service, token) as http:
            res = sw.send_run(http, service, database, device, problem, run_id, time.monotonic() + sw.WAIT_S,
                              name=name)
    except (ServiceError, httpx.HTTPError) as e:
        fail(f"{service}: {e}" + sw.pending_note(service))
        raise AssertionError from e
    w = res.get("winner") or {}
    return {"uploaded": res["recorded"], "winner": w.get("strategy"), "speedup": w.get("speedup"),
            "speedup_ci": [w.get("speedup_lo"), w.get("speedup_hi")], "baseline_s": w.get("baseline_s"),
            "winner_s": w.get("winner_s")}


def send_left(service: str, token: str | None) -> None:
    """What an earlier `tune --service` or worker kept and could not send, sent first (once: a
    service that is down now is not waited for; the uploads stay kept)."""
    import httpx

    from autotuner.errors import ServiceError
    from autotuner.tune import service_worker as sw

    try:
        with sw.http_client(service, token) as http:
            sw.send_pending(http, sw.outbox(service), time.monotonic(), say)
    except (ServiceError, httpx.HTTPError) as e:
        err.print(f"warning: {service}: {e}" + sw.pending_note(service), highlight=False)


def print_summary(rows: list[dict[str, Any]]) -> None:
    from autotuner.strategy import Strategy

    t = Table(title="tuned", show_lines=False)
    for col in ("problem", "winner", "speedup", "CI", "x traffic", "x overlap", "A/A +/-", "baseline ms",
                "winner ms", "bound ms", "eff", "trials", "failed", "time s"):
        t.add_column(col)
    for r in rows:
        w = Strategy.from_dict(r["winner"]).key if r["winner"] else "-" if r["error"] is None else "FAILED"
        w += " (unresolved)" if r.get("unresolved") else ""
        ci = r["speedup_ci"] or [None, None]
        aa = r.get("aa_width")
        t.add_row(r["name"], w, fmt(r["speedup"], ".3f"), f"{fmt(ci[0], '.2f')}-{fmt(ci[1], '.2f')}",
                  fmt(r.get("traffic_speedup"), ".3f"), fmt(r.get("overlap_speedup"), ".3f"),
                  "-" if aa is None else f"{aa * 100:.1f}%",
                  fmt(r["baseline_s"] and r["baseline_s"] * 1e3, ".2f"),
                  fmt(r["winner_s"] and r["winner_s"] * 1e3, ".2f"),
                  fmt(r["bound_s"] and r["bound_s"] * 1e3, ".2f"), fmt(r["efficiency"], ".2f"),
                  str(r["trials"]), "-" if r["failed"] is None else str(r["failed"]), fmt(r["seconds"], ".1f"))
    err.print(t)
    for r in rows:   # the reference stays for these: not a coin flip stored as a winner
        if r.get("unresolved"):
            err.print(f"{r['name']}: {r['unresolved']}", highlight=False)

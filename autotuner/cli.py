"""The `autotuner` command line (Typer). Progress and tables go to stderr, JSON to stdout."""

from __future__ import annotations

import json
import math
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Pick, per sharded einsum and device, the fastest collective/einsum overlap.")
db_app = typer.Typer(no_args_is_help=True, help="Manage the results database.")
app.add_typer(db_app, name="db")
err = Console(stderr=True, width=None if sys.stderr.isatty() else 150, emoji=False)


def fail(message: str, code: int = 2) -> None:
    err.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


def _db_url(db: str | None) -> str:
    from autotuner.settings import get_settings, normalize_db_url

    return normalize_db_url(db) if db else get_settings().db_url


def open_database(url: str, *, create: bool = True) -> Any:
    """The results database at `url`. A brand-new SQLite file is created by migration;
    anything else must already be at the current schema (SchemaError names the command)."""
    from db import Database, SchemaError, current_revision

    database = Database(url)
    try:
        database.check_schema()
    except SchemaError:
        if not (create and database.dialect == "sqlite" and current_revision(database.engine) is None
                and not _has_tables(database)):
            raise
        from autotuner.settings import redact_db_url

        err.print(f"creating the results database {redact_db_url(url)} (alembic upgrade head)")
        database.upgrade()
    return database


def _has_tables(database: Any) -> bool:
    from sqlalchemy import inspect

    return bool(inspect(database.engine).get_table_names())


# -- tune ------------------------------------------------------------------------------------------

def _load(problems: str | None, n: int, scale: float) -> list[tuple[str, Any]]:
    from .problems_file import ProblemsFileError, load_problems
    from .suite import suite

    if problems is None or problems == "suite":
        return [(name, p) for name, _regime, p in suite(n, scale=scale)]
    try:
        return [(f"{Path(problems).name}[{i}]", p) for i, p in enumerate(load_problems(problems))]
    except ProblemsFileError as e:
        fail(str(e))
        raise AssertionError from e


@app.command()
def tune(
    problems: Annotated[str | None, typer.Option("--problems", help="JSON, JSONL or YAML file of Problems, "
                                                 "or 'suite' for the built-in transformer suite")] = None,
    target: Annotated[str | None, typer.Option(help="inproc:N, lab:TOPOLOGY:N:RATE or local")] = None,
    db: Annotated[str | None, typer.Option("--db", help="database URL (default AUTOTUNER_DB_URL, "
                                           "else ./autotuner.db)")] = None,
    service: Annotated[str | None, typer.Option(help="upload results to this service URL instead")] = None,
    token: Annotated[str | None, typer.Option(help="write token for --service")] = None,
    trials: Annotated[int, typer.Option(min=1, help="trial budget per problem (search)")] = 24,
    seconds: Annotated[float | None, typer.Option(min=1, help="time budget per problem (search)")] = None,
    exhaustive: Annotated[bool, typer.Option(help="measure every strategy of the space")] = False,
    reps: Annotated[int, typer.Option(min=3, help="timed repetitions per strategy")] = 7,
    scale: Annotated[float, typer.Option(min=0.01, max=4.0, help="size factor for the built-in suite")] = 1.0,
    json_out: Annotated[bool, typer.Option("--json", help="one JSON object per problem on stdout")] = False,
) -> None:
    """Tune problems on a target and store the measurements and winners."""
    from .targets import Target, TargetError, TargetSession, default_target

    try:
        tgt = Target.parse(target or default_target())
    except TargetError as e:
        fail(str(e))
    items = _load(problems, tgt.n or 1, scale)
    if service and not token:
        fail("--service needs --token (a write token of the service)")
    if service and db:
        fail("give either --db (store locally) or --service (upload), not both")
    if service:
        from .worker import scratch_db_url

        database = open_database(scratch_db_url(service))  # the study and measurements, then uploaded
    else:
        database = open_database(_db_url(db))
    if not exhaustive:
        try:
            from . import search  # noqa: F401
        except ImportError:
            fail("the Optuna search is not available yet; run with --exhaustive")
    run_id = uuid.uuid4().hex[:12]
    rows: list[dict[str, Any]] = []
    err.print(f"target {tgt.text}: {len(items)} problem(s), run {run_id}", highlight=False)
    try:
        with TargetSession(tgt, log=lambda m: err.print(m, highlight=False)) as ts:
            err.print(f"device {ts.device.label} ({ts.device.key[:8]})", highlight=False)
            if not exhaustive:
                _say_model(database, ts.device)
            for name, problem in items:
                try:
                    ts.check(problem)
                except TargetError as e:
                    fail(f"{name}: {e}")
                row = _tune_one(ts, database, name, problem, run_id, exhaustive=exhaustive, trials=trials,
                                seconds=seconds, reps=reps)
                if service:
                    row.update(_upload(service, token, ts.device, problem, database, run_id))
                rows.append(row)
                if json_out:
                    sys.stdout.write(json.dumps(row) + "\n")
                    sys.stdout.flush()
    except TargetError as e:
        fail(str(e))
    _summary(rows)


def _say_model(database: Any, device: Any) -> None:
    from .costmodel import CostModelError, load_params

    try:
        load_params(database, device)
    except CostModelError:
        err.print("cost model: this device has no calibration (`autotuner calibrate`); "
                  "the search starts from the nearest tuned shapes only", highlight=False)
    else:
        err.print("cost model: the device's calibration orders the first trials", highlight=False)


def _tune_one(ts: Any, database: Any, name: str, problem: Any, run_id: str, *, exhaustive: bool,
              trials: int, seconds: float | None, reps: int) -> dict[str, Any]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from . import store
    from .measure import run_session
    from .space import space

    t0 = time.perf_counter()
    strategies = space(problem, ts.device)
    err.print(f"[bold]{name}[/]: {problem.describe()} — {len(strategies)} strategies", highlight=False)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True) as prog:
        if exhaustive:
            task = prog.add_task(f"{name}: compiling {len(strategies)}", total=reps)
            session = run_session(ts.runner(problem), problem, strategies, reps=reps,
                                  log=lambda m: err.print(m, highlight=False),
                                  on_rep=lambda r, n: prog.update(task, completed=r,
                                                                  description=f"{name}: timing"))
            winner = store.save(database, ts.device, problem, store.session_items(session, run_id))
            n_trials, failed = len(strategies), sum(c.status != "ok" for c in session.candidates)
            bound_s = session.bound_s
        else:
            from .search import tune_problem

            result = tune_problem(ts, database, problem, trials=trials, seconds=seconds, reps=reps,
                                  run_id=run_id, progress=prog, name=name)
            winner, n_trials, failed, bound_s = result.winner, result.trials, result.failed, result.bound_s
    eff = None
    if winner is not None and bound_s and winner.baseline_s and winner.winner_s:
        from .measure import efficiency

        eff = efficiency(winner.baseline_s, winner.winner_s, bound_s)
    return {"key": problem.key, "name": name, "problem": problem.to_dict(), "device": ts.device.to_dict(),
            "winner": winner.strategy if winner else None,
            "speedup": winner.speedup if winner else None,
            "speedup_ci": [winner.speedup_lo, winner.speedup_hi] if winner else None,
            "baseline_s": winner.baseline_s if winner else None,
            "winner_s": winner.winner_s if winner else None,
            "bound_s": bound_s, "efficiency": eff, "trials": n_trials,
            "seconds": round(time.perf_counter() - t0, 3), "failed": failed}


def _upload(service: str, token: str | None, device: Any, problem: Any, database: Any, run_id: str
            ) -> dict[str, Any]:
    """Send this run's measurements to the service; its winner replaces the local one."""
    import httpx

    from .worker import ServiceError, http_client, run_items, upload

    try:
        with http_client(service, token) as http:
            res = upload(http, device, problem, run_items(database, device, problem, run_id))
    except (ServiceError, httpx.HTTPError) as e:
        fail(f"{service}: {e} (the measurements stay in {database.url})")
        raise AssertionError from e
    w = res.get("winner") or {}
    return {"uploaded": res["recorded"], "winner": w.get("strategy"), "speedup": w.get("speedup"),
            "speedup_ci": [w.get("speedup_lo"), w.get("speedup_hi")], "baseline_s": w.get("baseline_s"),
            "winner_s": w.get("winner_s")}


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _summary(rows: list[dict[str, Any]]) -> None:
    from .strategy import Strategy

    t = Table(title="tuned", show_lines=False)
    for col in ("problem", "winner", "speedup", "CI", "baseline ms", "winner ms", "bound ms", "eff",
                "trials", "failed", "time s"):
        t.add_column(col)
    for r in rows:
        w = Strategy.from_dict(r["winner"]).key if r["winner"] else "-"
        ci = r["speedup_ci"] or [None, None]
        t.add_row(r["name"], w, _fmt(r["speedup"], ".3f"), f"{_fmt(ci[0], '.2f')}-{_fmt(ci[1], '.2f')}",
                  _fmt(r["baseline_s"] and r["baseline_s"] * 1e3, ".2f"),
                  _fmt(r["winner_s"] and r["winner_s"] * 1e3, ".2f"),
                  _fmt(r["bound_s"] and r["bound_s"] * 1e3, ".2f"), _fmt(r["efficiency"], ".2f"),
                  str(r["trials"]), str(r["failed"]), _fmt(r["seconds"], ".1f"))
    err.print(t)


# -- worker ----------------------------------------------------------------------------------------

@app.command()
def worker(
    service: Annotated[str, typer.Option(help="the service URL, e.g. http://autotuner:8000")],
    token: Annotated[str, typer.Option(envvar="AUTOTUNER_WORKER_TOKEN", help="a write token of the service")],
    target: Annotated[str | None, typer.Option(help="inproc:N, lab:TOPOLOGY:N:RATE or local")] = None,
    once: Annotated[bool, typer.Option(help="stop when no job is left instead of polling")] = False,
    poll: Annotated[float, typer.Option(min=0.1, help="seconds between claims when the queue is empty")] = 10.0,
    lease: Annotated[float, typer.Option(min=5, help="job lease in seconds, renewed while tuning")] = 300.0,
    trials: Annotated[int, typer.Option(min=1, help="default trial budget per job")] = 24,
    reps: Annotated[int, typer.Option(min=3)] = 7,
) -> None:
    """Claim tuning jobs for this target's device from the service, tune them, upload results."""
    import httpx

    from .targets import Target, TargetError, TargetSession, default_target
    from .worker import ServiceError, work

    try:
        tgt = Target.parse(target or default_target())
        with TargetSession(tgt, log=lambda m: err.print(m, highlight=False)) as ts:
            err.print(f"worker on {ts.device.label} ({ts.device.key[:8]}), service {service}", highlight=False)
            n = work(ts, service, token, once=once, poll_s=poll, lease_s=lease, trials=trials, reps=reps,
                     say=lambda m: err.print(m, highlight=False))
    except (TargetError, ServiceError) as e:
        fail(str(e))
    except httpx.HTTPError as e:
        fail(f"cannot reach {service}: {e}")
    err.print(f"{n} job(s) done")


# -- lab -------------------------------------------------------------------------------------------

@app.command()
def lab(
    topology: Annotated[str, typer.Option(help="none, shared or ring")] = "shared",
    n: Annotated[int, typer.Option("-n", "--n", min=1, max=8, help="processes")] = 2,
    rate: Annotated[str, typer.Option(help="tbf rate per link, e.g. 2gbit")] = "2gbit",
) -> None:
    """Start an emulated multi-host CPU mesh, run a collective across it, and stop it."""
    from .lab import LabError, LabSpec, run_lab_smoke

    try:
        spec = LabSpec.parse(f"lab:{topology}:{n}:{rate}" if topology != "none" else f"lab:none:{n}")
        result = run_lab_smoke(spec)
    except LabError as e:
        fail(str(e))
    sys.stdout.write(json.dumps(result, indent=2, default=str) + "\n")


# -- the main job (make run) -----------------------------------------------------------------------

def best_target() -> tuple[str, str]:
    """The best target this machine offers, and why."""
    import shutil
    import subprocess

    cores = os.cpu_count() or 1
    n = 2 if cores <= 4 else 4
    if os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc"):
        if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode == 0:
            return f"lab:shared:{n}:2gbit", (f"root with network namespaces and tc: {n} JAX processes "
                                              "over a loopback shaped to 2 Gbit/s, where overlap is real")
        why = "no network namespaces here"
    else:
        why = "not root" if os.geteuid() != 0 else "no ip/tc"
    return f"lab:none:{n}", (f"{why}: {n} JAX processes on plain loopback (no link shaping, so the "
                             "transfers are memory-speed and overlap gains small)")


def _start_with_fallback(tgt: Any) -> Any:
    """A session on `tgt`; a shaped lab that cannot start falls back to plain processes on
    loopback, and those to in-process devices, saying why each time."""
    from .targets import Target, TargetSession

    chain = [tgt]
    if tgt.kind == "lab":
        n = tgt.n or 2
        if not tgt.text.startswith("lab:none:"):
            chain.append(Target.parse(f"lab:none:{n}"))
        chain.append(Target.parse(f"inproc:{n}"))
    for i, t in enumerate(chain):
        try:
            return TargetSession(t, log=lambda m: err.print(m, highlight=False))
        except Exception as e:  # noqa: BLE001 - a lab that cannot start: fall back, say why
            if i == len(chain) - 1:
                raise
            err.print(f"{t.text} could not start ({e}); falling back to {chain[i + 1].text}", highlight=False)
    raise AssertionError("unreachable")


@app.command()
def up(
    host: Annotated[str, typer.Option(help="address the service listens on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8000,
    db: Annotated[str | None, typer.Option("--db", help="database URL (default ./autotuner.db)")] = None,
    target: Annotated[str | None, typer.Option(help="override the chosen target")] = None,
    trials: Annotated[int, typer.Option(min=1, help="trial budget per shape")] = 6,
    reps: Annotated[int, typer.Option(min=3)] = 5,
    tune_only: Annotated[bool, typer.Option(help="tune, then exit without serving")] = False,
) -> None:
    """The main job: tune the built-in transformer suite on the best target here, store the
    results in the database, then serve them with the dashboard."""
    from .suite import suite
    from .targets import Target, TargetError

    chosen, why = (target, "given with --target") if target else best_target()
    err.print(f"target {chosen}: {why}", highlight=False)
    url = _db_url(db)
    database = open_database(url)
    t0 = time.perf_counter()
    rows = []
    try:
        ts = _start_with_fallback(Target.parse(chosen))
        with ts:
            err.print(f"device {ts.device.label} ({ts.device.key[:8]})", highlight=False)
            _say_model(database, ts.device)
            run_id = uuid.uuid4().hex[:12]
            for name, _regime, p in suite(ts.device.num_devices):
                rows.append(_tune_one(ts, database, name, p, run_id, exhaustive=False, trials=trials,
                                      seconds=None, reps=reps))
    except TargetError as e:
        fail(str(e))
    _summary(rows)
    err.print(f"tuned {len(rows)} shapes in {time.perf_counter() - t0:.0f} s into {url}", highlight=False)
    if tune_only:
        return
    import uvicorn

    from autotuner.settings import get_settings

    os.environ["AUTOTUNER_DB_URL"] = url
    get_settings.cache_clear()
    err.print(f"dashboard: http://{host}:{port}/   (API: http://{host}:{port}/docs; Ctrl-C stops)",
              highlight=False)
    uvicorn.run("service.app:app", host=host, port=port, log_level="warning")


# -- demo ------------------------------------------------------------------------------------------

@app.command()
def demo(
    n: Annotated[int, typer.Option("-n", min=2, max=8, help="in-process CPU devices")] = 4,
    reps: Annotated[int, typer.Option(min=3)] = 5,
) -> None:
    """Correctness and timing of every strategy on two small problems, on in-process devices."""
    from .targets import prepare_inproc

    prepare_inproc(n)
    import jax

    from .measure import LocalRunner, run_session
    from .space import space
    from .suite import suite

    err.print(f"{jax.device_count()} in-process CPU devices (numbers only: in-process devices share one "
              "thread pool, so these timings say nothing about overlap; use a lab target for that)")
    rows = []
    for name, _regime, p in suite(n, scale=0.25)[:1] + suite(n, scale=0.25)[4:5]:
        mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
        s = run_session(LocalRunner(mesh), p, space(p), reps=reps)
        bad = [c for c in s.candidates if c.status != "ok"]
        rows.append((name, p, s, bad))
    t = Table(title="demo: every strategy checked against the baseline, then timed")
    for col in ("problem", "pattern", "strategies", "failed", "max rel. error", "fastest", "ratio"):
        t.add_column(col)
    for name, p, s, bad in rows:
        best = s.best()
        t.add_row(name, p.pattern.label, str(len(s.candidates) + 1), str(len(bad)),
                  f"{max(c.error or 0.0 for c in s.candidates):.2e}", best.key, _fmt(best.ratio, ".3f"))
    err.print(t)
    if any(bad for *_, bad in rows):
        fail("some strategies failed: " + "; ".join(f"{c.key}: {c.reason}" for *_, b in rows for c in b), 1)


# -- db --------------------------------------------------------------------------------------------

@db_app.command("upgrade")
def db_upgrade(
    db: Annotated[str | None, typer.Option("--db", help="database URL (default AUTOTUNER_DB_URL)")] = None,
    revision: Annotated[str, typer.Option(help="target revision")] = "head",
) -> None:
    """Create or migrate the schema (alembic upgrade)."""
    from autotuner.settings import redact_db_url
    from db import Database

    url = _db_url(db)
    Database(url).upgrade(revision)
    err.print(f"database {redact_db_url(url)} is at revision {revision}")


def _register_plugins() -> None:
    from .cli_costmodel import register as register_costmodel
    from .cli_extract import register as register_extract
    from .cli_service import register as register_service

    register_extract(app)
    register_service(app)
    register_costmodel(app)


_register_plugins()


def main() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        app()
    except Exception as e:  # noqa: BLE001 - a clear message, never a traceback
        from db import SchemaError, StorageError

        if isinstance(e, (SchemaError, StorageError)):
            err.print(f"[bold red]error:[/] {e}", highlight=False)
            sys.exit(2)
        raise


if __name__ == "__main__":
    main()

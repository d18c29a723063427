"""`autotuner up` (the main job: tune the built-in suite on the best target here, then serve
the results) and `autotuner demo` (every strategy checked and timed on in-process devices)."""

from __future__ import annotations

import os
import time
import uuid
from typing import Annotated, Any

import typer
from rich.table import Table

from autotuner.cli.common import DB_HELP, app, db_url, err, fail, fmt, open_database, say
from autotuner.cli.tune import print_summary, say_model, stop_interrupted, tune_one

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
    from autotuner.measure.targets import Target, TargetSession

    chain = [tgt]
    if tgt.kind == "lab":
        n = tgt.n or 2
        if not tgt.text.startswith("lab:none:"):
            chain.append(Target.parse(f"lab:none:{n}"))
        chain.append(Target.parse(f"inproc:{n}"))
    for i, t in enumerate(chain):
        try:
            return TargetSession(t, log=say)
        except Exception as e:  # noqa: BLE001 - a lab that cannot start: fall back, say why
            if i == len(chain) - 1:
                raise
            err.print(f"{t.text} could not start ({e}); falling back to {chain[i + 1].text}", highlight=False)
    raise AssertionError("unreachable")


@app.command()
def up(
    host: Annotated[str, typer.Option(help="address the service listens on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8000,
    db: Annotated[str | None, typer.Option("--db", help=DB_HELP)] = None,
    target: Annotated[str | None, typer.Option(help="override the chosen target")] = None,
    trials: Annotated[int, typer.Option(min=1, help="trial budget per shape")] = 6,
    reps: Annotated[int, typer.Option(min=3)] = 5,
    tune_only: Annotated[bool, typer.Option(help="tune, then exit without serving")] = False,
    bench: Annotated[bool, typer.Option("--bench/--no-bench", help="then tune the example's training "
                                        "step and benchmark it plain vs overlapped")] = True,
) -> None:
    """The main job: tune the built-in transformer suite on the best target here, store the
    results in the database, then (--bench) tune the example transformer's training step and
    show `bench-model`'s figure for it, then serve them with the dashboard."""
    from autotuner.measure.targets import Target, TargetError
    from autotuner.problem.suite import suite

    chosen, why = (target, "given with --target") if target else best_target()
    err.print(f"target {chosen}: {why}", highlight=False)
    url = db_url(db)
    database = open_database(url)
    t0 = time.perf_counter()
    rows = []
    interrupted, shapes = False, []
    try:
        ts = _start_with_fallback(Target.parse(chosen))
        used = ts.target.text
        with ts:
            err.print(f"device {ts.device.label} ({ts.device.key[:8]})", highlight=False)
            say_model(database, ts.device)
            run_id = uuid.uuid4().hex[:12]
            shapes = list(suite(ts.device.num_devices))
            try:
                for name, _regime, p in shapes:
                    rows.append(tune_one(ts, database, name, p, run_id, exhaustive=False, trials=trials,
                                          seconds=None, reps=reps))
            except KeyboardInterrupt:   # Ctrl-C: what is done is summarised, the target closed as ever
                interrupted = True
    except TargetError as e:
        fail(str(e))
    if interrupted:
        stop_interrupted(rows, len(shapes))
    print_summary(rows)
    err.print(f"tuned {len(rows)} shapes in {time.perf_counter() - t0:.0f} s into {url}", highlight=False)
    if bench:
        bench_example(used, url, ts.num_devices, trials=trials, reps=reps)
    if tune_only:
        return
    import uvicorn

    from autotuner.settings import get_settings

    os.environ["AUTOTUNER_DB_URL"] = url
    get_settings.cache_clear()
    err.print(f"dashboard: http://{host}:{port}/   (API: http://{host}:{port}/docs; Ctrl-C stops)",
              highlight=False)
    uvicorn.run("service.app:app", host=host, port=port, log_level="warning")


# The example's training step at a shape where its collectives are a large share of the step on a
# 2 Gbit/s lab (README, "The compiler pass"): one layer, 8 x 128 tokens, d_model 512, d_ff 512.
EXAMPLE_STEP = {"layers": 1, "batch": 8, "seq": 128, "d_model": 512, "heads": 8, "d_head": 16, "d_ff": 512}


def bench_example(target: str, url: str, n: int, *, trials: int, reps: int) -> None:
    """extract -> tune -> bench-model for the example's training step on `target`, each a
    subprocess of this CLI (each starts its own devices or lab); failures are reported, not raised."""
    import json
    import subprocess
    import sys
    import tempfile

    factory = "autotuner.examples.transformer:train_step"
    common = ["--mesh", json.dumps({"model": n}), "--kwargs", json.dumps(EXAMPLE_STEP), "--explicit"]
    with tempfile.TemporaryDirectory(prefix="autotuner-up-") as tmp:
        problems = os.path.join(tmp, "step.json")
        steps = [["extract", factory, *common, "-q", "-o", problems],
                 ["tune", "--problems", problems, "--target", target, "--db", url, "--trials", str(trials),
                  "--reps", str(reps)],
                 ["bench-model", factory, *common, "--target", target, "--db", url]]
        for argv in steps:
            err.print(f"$ autotuner {' '.join(argv)}", highlight=False)
            if subprocess.run([sys.executable, "-m", "autotuner.cli", *argv]).returncode != 0:
                err.print(f"autotuner {argv[0]} failed; the benchmark of the example's step is skipped",
                          highlight=False)
                return


# -- demo ------------------------------------------------------------------------------------------

@app.command()
def demo(
    n: Annotated[int, typer.Option("-n", min=2, max=8, help="in-process CPU devices")] = 4,
    reps: Annotated[int, typer.Option(min=3)] = 5,
) -> None:
    """Correctness and timing of every strategy on two small problems, on in-process devices."""
    from autotuner.measure.targets import prepare_inproc

    prepare_inproc(n)
    import jax

    from autotuner.decompose.space import space
    from autotuner.measure import LocalRunner, run_session
    from autotuner.problem.suite import suite

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
                  f"{max(c.error or 0.0 for c in s.candidates):.2e}", best.key, fmt(best.ratio, ".3f"))
    err.print(t)
    if any(bad for *_, bad in rows):
        fail("some strategies failed: " + "; ".join(f"{c.key}: {c.reason}" for *_, b in rows for c in b), 1)

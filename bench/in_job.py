"""A training job that tunes itself: the example's training step, one JAX process per host, with
`overlap(step, client=..., tune="missing")`. Run it once per host as a multi-host JAX job is run;
on this machine, under the lab, against a service on this host:

    export TOKEN=$(openssl rand -hex 16)
    AUTOTUNER_WRITE_TOKENS=$TOKEN autotuner serve --db sqlite:///job.db &
    AUTOTUNER_SERVICE_TOKEN=$TOKEN autotuner lab run --service http://127.0.0.1:8000 \\
        lab:shared:2:2gbit -- python bench/in_job.py --budget 120

Each process joins the job from JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID
(`autotuner lab run` sets them; a cluster's launcher does the same), prepares the step (the first
run measures every problem the service has no tuned winner for, within the budget, and uploads
it), then times plain jit and the overlapped step interleaved. Process 0 prints: how many pairs
were measured in this job and what it cost, how many rest on tuned answers, and the speedup with
its 95% interval. A second run with the same shapes measures nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

EXAMPLE = {"layers": 1, "batch": 8, "seq": 128, "d_model": 512, "heads": 8, "d_head": 16, "d_ff": 512}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=120.0, help="in-job tuning budget, seconds")
    ap.add_argument("--reps", type=int, default=20, help="timed steps of each program")
    ap.add_argument("--kwargs", default=json.dumps(EXAMPLE), help="the example's shape (JSON)")
    a = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import jax

    n = int(os.environ.get("JAX_NUM_PROCESSES", "1"))
    if n > 1:
        jax.distributed.initialize(os.environ["JAX_COORDINATOR_ADDRESS"], n, int(os.environ["JAX_PROCESS_ID"]))
    from jax.sharding import AxisType

    from autotuner import Client, overlap
    from autotuner.examples.transformer import train_step
    from autotuner.measure.steps import compare, time_steps
    from autotuner.overlap.injob import JaxSync

    url = os.environ.get("AUTOTUNER_SERVICE_URL")
    if not url:
        sys.exit("AUTOTUNER_SERVICE_URL is not set (autotuner lab run --service URL sets it)")
    mesh = jax.make_mesh((jax.device_count(),), ("model",), axis_types=(AxisType.Explicit,))
    fn, args = train_step(mesh=mesh, **json.loads(a.kwargs))
    client = Client(url, token=os.environ.get("AUTOTUNER_SERVICE_TOKEN"))
    t0 = time.perf_counter()
    step = overlap(fn, client=client, tune="missing", tune_budget_s=a.budget)
    plan = step.plan(*args)
    prepared = time.perf_counter() - t0
    plain = fn if hasattr(fn, "lower") else jax.jit(fn)
    samples = time_steps([lambda: plain(*args), lambda: step(*args)], reps=a.reps, sync=JaxSync("in-job-bench"))
    res = compare(*samples, a.reps)
    if jax.process_index() == 0:
        print(plan)
        sources = {s: sum(r.source == s for r in plan) for s in ("in-job", "tuned")}
        print(f"{len(plan)} pairs: {sources['in-job']} measured in this job, {sources['tuned']} tuned answers; "
              f"prepared in {prepared:.1f} s (budget {a.budget:g} s)")
        print(f"plain {res.plain.median_s * 1e3:.2f} ms, overlapped {res.overlapped.median_s * 1e3:.2f} ms, "
              f"speedup {res.speedup:.3f}x [{res.speedup_lo:.3f}, {res.speedup_hi:.3f}] ({a.reps} steps each)")


if __name__ == "__main__":
    main()

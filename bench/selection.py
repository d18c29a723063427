"""Benchmark: how close the tuner gets to the exhaustive optimum, and at what cost.

    python bench/selection.py --target lab:ring:4:1gbit --fraction 0.2
    python bench/selection.py --target lab:shared:2:2gbit --shapes mlp_up_balanced,attn_out

Per shape of the suite: (1) exhaustive: every strategy of the space in one session, timed;
(2) tuned: `autotuner.tune.search.tune_problem` with a trial budget into a fresh database shared by
the shapes (so later shapes warm-start from earlier winners), timed; (3) a final interleaved
session of the baseline, the exhaustive optimum and the tuned winner with more repetitions, which
gives both speedups side by side (the exhaustive pick's own session flatters it: the maximum of
many noisy ratios). Prints the gap to the optimum and the time ratio.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from autotuner.decompose.space import space
from autotuner.measure import run_session
from autotuner.measure.targets import Target, TargetSession
from autotuner.problem.suite import suite
from autotuner.strategy import Strategy
from autotuner.tune.search import tune_problem

out = Console(width=240, emoji=False)  # strategy keys unabridged when piped


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="lab:ring:4:1gbit")
    ap.add_argument("--shapes", default="mlp_up_balanced,mlp_up_comm,qkv,attn_out,mlp_down_balanced")
    ap.add_argument("--fraction", type=float, default=0.2,
                    help="trial budget as a fraction of each shape's space (at least 4 trials)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--check-reps", type=int, default=15)
    ap.add_argument("--scale", type=float, default=1.0)
    args = ap.parse_args()
    from db import Database

    tmp = Path(tempfile.mkdtemp(prefix="selection-"))
    database = Database(f"sqlite:///{tmp / 'tuned.db'}")
    database.upgrade()
    wanted = args.shapes.split(",")
    t = Table(title=f"tuned vs exhaustive on {args.target} (speedups from one final interleaved session)")
    for col in ("shape", "space", "exhaustive best", "speedup", "time s", "tuned winner", "speedup",
                "trials", "time s", "time ratio", "gap to optimum", "tuned vs baseline CI"):
        t.add_column(col)
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    worst_gap, worst_time = 0.0, 0.0
    with TargetSession(Target.parse(args.target), log=log) as ts:
        n = ts.device.num_devices
        for name, _regime, p in suite(n, scale=args.scale):
            if name not in wanted:
                continue
            strategies = space(p, ts.device)
            log(f"{name}: exhaustive over {len(strategies)}")
            t0 = time.perf_counter()
            ex = run_session(ts.runner(p), p, strategies, reps=args.reps)
            t_ex = time.perf_counter() - t0
            best = Strategy.from_dict(ex.best().strategy)
            trials = max(4, round(args.fraction * (len(strategies) - 1)))
            log(f"{name}: tuning with {trials} trials")
            t1 = time.perf_counter()
            res = tune_problem(ts, database, p, trials=trials, reps=args.reps, name=name, seed=0)
            t_tune = time.perf_counter() - t1
            tuned = Strategy.from_dict(dict(res.winner.strategy)) if res.winner else Strategy.baseline()
            check = [Strategy.baseline()] + list(dict.fromkeys(s for s in (best, tuned) if not s.is_baseline))
            log(f"{name}: final check of {[s.key for s in check]}")
            fin = run_session(ts.runner(p), p, check, reps=args.check_reps)
            by = {c.key: c for c in [fin.baseline, *fin.candidates]}
            r_best, r_tuned = by[best.key].ratio, by[tuned.key].ratio
            gap = max(0.0, 1 - r_tuned / r_best) if r_best and r_tuned else float("nan")
            worst_gap = max(worst_gap, gap)
            worst_time = max(worst_time, t_tune / t_ex)
            c = by[tuned.key]
            ci = "baseline" if tuned.is_baseline else f"{c.ratio_lo:.2f}-{c.ratio_hi:.2f}"
            t.add_row(name, str(len(strategies)), best.key, f"{r_best:.3f}", f"{t_ex:.0f}", tuned.key,
                      f"{r_tuned:.3f}", str(res.trials), f"{t_tune:.0f}", f"{t_tune / t_ex:.2f}",
                      f"{100 * gap:.1f}%", ci)
    out.print(t)
    out.print(f"worst gap to the exhaustive optimum {100 * worst_gap:.1f}%, worst time ratio {worst_time:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

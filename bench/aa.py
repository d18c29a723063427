"""Benchmark: the A/A check, the harness measuring one program against itself.

    python bench/aa.py                                       # lab shared:2:2gbit, mlp_up_balanced, 3 sessions
    python bench/aa.py --target lab:ring:4:1gbit --shapes mlp_up_comm --sessions 5
    python bench/aa.py --problems issue13.json --precision 0.05 --precision-seconds 60

Each session enters the same program twice (the baseline, compiled twice, timed interleaved as
two candidates) and repeats until the ratio's CI is within +/- --precision or the time budget
ends (`--precision 0`: exactly --reps). The check passes when the paired bootstrap 95% CI of
the ratio contains 1.0 and is within +/- --tolerance of it (the width reported is how far the CI
reaches from 1.0). With --strategy the same is done for that strategy instead of the baseline.
Needs root for the lab's shared/ring topologies (network namespaces).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from rich.console import Console
from rich.table import Table

from autotuner import Problem, Strategy
from autotuner.measure import (
    Candidate,
    Precision,
    aa_ok,
    aa_width,
    halfwidth,
    ratio_ci,
    run_session,
)
from autotuner.measure.targets import Target, TargetSession
from autotuner.problem.problems_file import load_problems
from autotuner.problem.suite import suite

out = Console(width=200, emoji=False)


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"


def problems(args: argparse.Namespace, n: int) -> list[tuple[str, Problem]]:
    if args.problems:
        return [(f"{args.problems}[{i}]", p) for i, p in enumerate(load_problems(args.problems))]
    wanted = args.shapes.split(",")
    found = [(name, p) for name, _regime, p in suite(n) if name in wanted]
    if len(found) != len(wanted):
        raise SystemExit(f"unknown shape in {args.shapes!r}; the suite has: "
                         + ", ".join(name for name, _r, _p in suite(n)))
    return found


def aa_session(ts: TargetSession, p: Problem, program: Strategy, reps: int, precision: Precision
               ) -> tuple[Candidate, Candidate, str]:
    """One session with `program` entered twice: (A, A' with its ratio A/A' and CI, why it stopped).
    The baseline's twin is the harness's own (`aa=True`); another strategy is entered twice beside
    the baseline, and its two copies are compared with each other."""
    runner = ts.runner(p)
    if program.is_baseline:
        s = run_session(runner, p, [program], reps=reps, aa=True, precision=precision, parts=False)
        assert s.aa is not None
        return s.baseline, s.aa, s.stop
    s = run_session(runner, p, [Strategy.baseline(), program, program], reps=reps, precision=precision,
                    parts=False)
    a, b = s.candidates
    if a.status == "ok" and b.status == "ok":
        r, lo, hi = ratio_ci(a.samples, b.samples)
        b.ratio, b.ratio_lo, b.ratio_hi = r, (None if math.isnan(lo) else lo), (None if math.isnan(hi) else hi)
    return a, b, s.stop


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="lab:shared:2:2gbit", help="inproc:N, lab:TOPOLOGY:N:RATE or local")
    ap.add_argument("--problems", help="a problems file (default: --shapes of the built-in suite)")
    ap.add_argument("--shapes", default="mlp_up_balanced", help="comma-separated suite names")
    ap.add_argument("--strategy", help="a strategy key or JSON to check instead of the baseline")
    ap.add_argument("--sessions", type=int, default=3)
    ap.add_argument("--reps", type=int, default=7, help="fixed repetitions before the adaptive ones")
    ap.add_argument("--precision", type=float, default=0.05, help="repeat until the CI is within +/- this")
    ap.add_argument("--precision-seconds", type=float, default=60.0, help="time budget of the extra reps")
    ap.add_argument("--tolerance", type=float, default=0.05, help="the check: CI within 1 +/- this")
    ap.add_argument("--json", help="also write every session as JSON lines to this file")
    args = ap.parse_args()
    precision = Precision(target=args.precision, seconds=args.precision_seconds)
    table = Table(title=f"A/A: one program against itself ({args.target}); pass = 95% CI contains 1.0 "
                        f"and is within +/-{args.tolerance:.0%}")
    for col in ("problem", "program", "session", "reps", "stop", "A ms", "A' ms", "IQR ms", "ratio", "95% CI",
                "+/-", "width", "check", "load before", "load after"):
        table.add_column(col, no_wrap=col in ("problem", "program"))
    sink = open(args.json, "w") if args.json else None  # noqa: SIM115
    failures = 0
    tgt = Target.parse(args.target)
    with TargetSession(tgt, log=lambda m: print(m, file=sys.stderr)) as ts:
        for name, p in problems(args, tgt.n or 1):
            program = Strategy.baseline()
            if args.strategy:
                # imports JAX: only once the target has set it up
                from autotuner.decompose.space import space

                program = (Strategy.from_dict(json.loads(args.strategy)) if args.strategy.startswith("{")
                           else next((s for s in space(p, ts.device) if s.key == args.strategy), None))
                if program is None:
                    raise SystemExit(f"{name}: no strategy {args.strategy!r} in its space")
            for i in range(args.sessions):
                before = loadavg()
                t0 = time.perf_counter()
                a, b, stop = aa_session(ts, p, program, args.reps, precision)
                after = loadavg()
                ok = aa_ok(b.ratio_lo, b.ratio_hi, args.tolerance)
                failures += not ok
                hw = halfwidth(b.ratio, b.ratio_lo, b.ratio_hi)
                width = aa_width(b.ratio_lo, b.ratio_hi)
                table.add_row(name, program.key, str(i + 1), str(b.n), stop, ms(a.median_s), ms(b.median_s),
                              ms(a.iqr_s), "-" if b.ratio is None else f"{b.ratio:.4f}",
                              "-" if b.ratio_lo is None else f"{b.ratio_lo:.3f}-{b.ratio_hi:.3f}",
                              "-" if hw is None else f"{hw:.1%}", "-" if width is None else f"{width:.1%}",
                              "pass" if ok else "FAIL", before, after)
                print(f"{name} session {i + 1}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
                if sink:
                    sink.write(json.dumps({"target": args.target, "problem": name, "program": program.key,
                                           "session": i + 1, "load": [before, after], "a": a.to_dict(),
                                           "b": b.to_dict()}) + "\n")
                    sink.flush()
    out.print(table)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: the transformer suite on the lab, every strategy measured side by side.

    python bench/lab_suite.py                         # 2 and 4 processes, shared and ring
    python bench/lab_suite.py --config shared:2:2gbit --shapes mlp_up_balanced --reps 9

Per (topology, processes) and shape: each strategy's median and IQR, its speedup over the
baseline measured in the same interleaved session (with the bootstrap 95% CI), the overlap
efficiency against the bound max(T_comm, T_comp) + fill, and the winner by the service's rule
(a decomposition wins only if its CI is above 1). Needs root for shared/ring (network namespaces).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from rich.console import Console
from rich.table import Table

from autotuner.decompose.space import space
from autotuner.lab import LabSpec
from autotuner.measure import SessionResult, run_session
from autotuner.measure.targets import Target, TargetSession
from autotuner.problem.suite import suite

CONFIGS = ["shared:2:2gbit", "shared:4:2gbit", "ring:2:1gbit", "ring:4:1gbit"]
out = Console(width=250, emoji=False)  # wide enough for the summary when piped


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def winner(s: SessionResult) -> str:
    best = [c for c in s.candidates if c.status == "ok" and c.ratio_lo is not None and c.ratio_lo > 1.0]
    return max(best, key=lambda c: c.ratio).key if best else "baseline"


def best_of(s: SessionResult, direction: str) -> float | None:
    """The fastest ring of one direction in the session (None: no such strategy ran)."""
    times = [c.median_s for c in s.candidates if c.status == "ok" and c.median_s is not None
             and c.strategy.get("direction") == direction]
    return min(times) if times else None


def shape_table(title: str, s: SessionResult, top: int) -> Table:
    t = Table(title=title, title_justify="left")
    for col in ("strategy", "median ms", "IQR ms", "speedup", "95% CI", "efficiency", "status"):
        t.add_column(col)
    rows = sorted([s.baseline, *s.candidates], key=lambda c: c.median_s if c.median_s is not None else 1e9)
    for c in rows[:top] + [c for c in rows[top:] if c.key == "baseline"]:
        ci = "-" if c.ratio_lo is None else f"{c.ratio_lo:.2f}-{c.ratio_hi:.2f}"
        t.add_row(c.key, ms(c.median_s), ms(c.iqr_s), "-" if c.ratio is None else f"{c.ratio:.3f}", ci,
                  "-" if c.efficiency is None else f"{c.efficiency:.2f}", c.status if not c.reason else c.reason[:60])
    return t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", action="append", help=f"TOPOLOGY:N:RATE (default: {' '.join(CONFIGS)})")
    ap.add_argument("--shapes", help="comma-separated suite names (default: all)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--top", type=int, default=8, help="strategies shown per shape")
    ap.add_argument("--json", help="also write every session as JSON lines to this file")
    args = ap.parse_args()
    configs = args.config or CONFIGS
    wanted = set(args.shapes.split(",")) if args.shapes else None
    summary = Table(title="lab suite: winners (speedup over baseline measured in the same session)")
    for col in ("config", "shape", "regime", "strategies", "comm ms", "comp ms", "bound ms", "baseline ms",
                "best uni ms", "best bidi ms", "best ms", "best", "speedup", "95% CI", "eff", "winner"):
        summary.add_column(col, no_wrap=col in ("config", "best", "winner"))
    sink = open(args.json, "w") if args.json else None  # noqa: SIM115
    for cfg in configs:
        spec = LabSpec.parse(f"lab:{cfg}")
        t0 = time.time()
        with TargetSession(Target.parse(f"lab:{cfg}"), log=lambda m: print(m, file=sys.stderr)) as ts:
            for name, regime, p in suite(spec.n):
                if wanted and name not in wanted:
                    continue
                strategies = space(p, ts.device)
                print(f"[{cfg}] {name}: {p.describe()}: {len(strategies)} strategies", file=sys.stderr)
                s = run_session(ts.runner(p), p, strategies, reps=args.reps,
                                log=lambda m: print(m, file=sys.stderr))
                out.print(shape_table(f"[{cfg}] {name} ({regime}): comm {ms(s.comm_s)} ms, comp {ms(s.comp_s)} ms, "
                                      f"bound {ms(s.bound_s)} ms", s, args.top))
                best = s.best()
                summary.add_row(cfg, name, regime, str(len(strategies)), ms(s.comm_s), ms(s.comp_s), ms(s.bound_s),
                                ms(s.baseline.median_s), ms(best_of(s, "uni")), ms(best_of(s, "bidi")),
                                ms(best.median_s), best.key,
                                "-" if best.ratio is None else f"{best.ratio:.3f}",
                                "-" if best.ratio_lo is None else f"{best.ratio_lo:.2f}-{best.ratio_hi:.2f}",
                                "-" if best.efficiency is None else f"{best.efficiency:.2f}", winner(s))
                if sink:
                    sink.write(json.dumps({"config": cfg, "shape": name, "session": s.to_dict()}) + "\n")
                    sink.flush()
        print(f"[{cfg}] done in {time.time() - t0:.0f} s", file=sys.stderr)
    out.print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())

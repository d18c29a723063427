"""Benchmark: how much of the possible overlap the best strategy captures, 3-D/4-D vs 2-D.

    python bench/overlap_gap.py                                    # every suite shape, both configs
    python bench/overlap_gap.py --config shared:2:2gbit --shapes mlp_up_balanced --reps 9

For each suite shape, each form of its matmul (`2d`: as the suite poses it; `3d`: with a
leading batch letter of size 1, `bsd,df->bsf` / `bsf,fd->bsd`, the MLP projections of a real
model; `4d`: the sharded width split in heads x 64, `bsd,dhk->bshk` / `bshk,hkd->bsd`), and each
lab config, one interleaved session of every strategy in the space: the best strategy, the
collective alone, the einsum alone, the bound, the efficiency (T_base - T_win) / (T_base -
T_bound), and the best form's time over the 2-D form's.
Forms are timed in separate sessions, so `vs 2d` carries the drift between sessions (a few
percent on this machine, more with 4 processes on 2 cores), and the forms' best strategies may
differ (each session picks among strategies within its noise). `--confirm K` then runs K
rounds, each a short session per form back to back, timing the 2-D form's best strategy and the
form's own best: `2d's best, vs 2d` is the median over rounds of that one strategy's time on the
form over its time on the 2-D form in the same round [lowest, highest round] (what the form
costs), `own best, vs 2d` the same for each form's own best (what separate choices add). The suite's `qkv` is 3-D with batch 2
(`bsd,dh->bsh`, s sharded): its `2d` form is the same matmul with (b, s) flattened, which a
ring cannot reach by reshaping alone (the sharded s is not the outer letter), so it shows the
part of the gap canonicalisation leaves. All sessions of one config run in one lab session,
forms of a shape back to back. Needs root for the lab (network namespaces).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from rich.console import Console
from rich.table import Table

from autotuner.decompose.space import space
from autotuner.lab import LabSpec
from autotuner.measure import run_session
from autotuner.measure.targets import Target, TargetSession
from autotuner.problem import Problem
from autotuner.problem.suite import suite
from autotuner.strategy import Strategy

CONFIGS = ["shared:2:2gbit", "ring:4:1gbit"]
FORMS = ("2d", "3d", "4d")
HEAD = 64
out = Console(width=250, emoji=False)


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def forms(p: Problem) -> dict[str, Problem]:
    """The suite problem `p` posed as 2-D, 3-D and 4-D einsums of the same matmul."""
    d = p.to_dict()
    (l0, l1), r1 = p.lhs.shape[-2:], p.rhs.shape[-1]
    axis = p.pattern.axis
    base = {"dtype": d["dtype"], "mesh": d["mesh"]}
    if p.equation == "bsd,dh->bsh":  # qkv: 3-D with batch 2 as the suite has it; 2-D flattened
        b, s, dm = p.lhs.shape
        flat = {"equation": "sd,dh->sh", "lhs": {"shape": [b * s, dm], "spec": [axis, None]},
                "rhs": d["rhs"], "out_spec": [None, axis], **base}
        return {"2d": Problem.from_dict(flat), "3d": p}
    if p.pattern.kind == "all_gather":  # sd,df->sf
        s, dm, f = l0, l1, r1
        return {"2d": p,
                "3d": Problem.from_dict({"equation": "bsd,df->bsf", "lhs": {"shape": [1, s, dm], "spec": [None, axis, None]},
                                         "rhs": d["rhs"], "out_spec": [None, None, axis], **base}),
                "4d": Problem.from_dict({"equation": "bsd,dhk->bshk",
                                         "lhs": {"shape": [1, s, dm], "spec": [None, axis, None]},
                                         "rhs": {"shape": [dm, f // HEAD, HEAD], "spec": [None, axis, None]},
                                         "out_spec": [None, None, axis, None], **base})}
    s, f, dm = l0, l1, r1  # sf,fd->sd
    return {"2d": p,
            "3d": Problem.from_dict({"equation": "bsf,fd->bsd", "lhs": {"shape": [1, s, f], "spec": [None, None, axis]},
                                     "rhs": d["rhs"], "out_spec": [None, axis, None], **base}),
            "4d": Problem.from_dict({"equation": "bshk,hkd->bsd",
                                     "lhs": {"shape": [1, s, f // HEAD, HEAD], "spec": [None, None, axis, None]},
                                     "rhs": {"shape": [f // HEAD, HEAD, dm], "spec": [axis, None, None]},
                                     "out_spec": [None, axis, None], **base})}


def confirm(ts: TargetSession, chosen: dict[str, tuple[Problem, Strategy]], k: int, reps: int,
            cfg: str, name: str) -> dict[str, tuple[str, str]]:
    """K rounds, each one session per form, back to back, timing its baseline, the 2-D form's best
    strategy and its own best. Per form: (the 2-D form's best strategy on this form over the same
    strategy on the 2-D form, this form's best over the 2-D form's best), each the median over
    rounds of the ratio within a round [lowest, highest]. The first isolates what the form costs;
    the second adds what choosing among the strategies in separate sessions costs."""
    if "2d" not in chosen:
        return {}
    ref = chosen["2d"][1]
    same: dict[str, list[float]] = {f: [] for f in chosen}
    own: dict[str, list[float]] = {f: [] for f in chosen}
    for r in range(k):
        t_same, t_own = {}, {}
        for form, (q, best) in chosen.items():
            s = run_session(ts.runner(q), q, [ref] if best == ref else [ref, best], reps=reps, parts=False)
            by_key = {c.key: c.median_s for c in [s.baseline, *s.ok()]}
            t_same[form], t_own[form] = by_key.get(ref.key), by_key.get(best.key)
        print(f"[{cfg}] {name} round {r + 1}/{k}: " + " ".join(
            f"{f} {ms(t_same[f])} (own best {ms(t_own[f])})" for f in chosen), file=sys.stderr)
        for times, ratios in ((t_same, same), (t_own, own)):
            if all(v is not None for v in times.values()):
                for form, v in times.items():
                    ratios[form].append(v / times["2d"])

    def fmt(v: list[float]) -> str:
        return f"{statistics.median(v):.3f} [{min(v):.3f}, {max(v):.3f}]" if v else "-"

    return {f: (fmt(same[f]), fmt(own[f])) for f in chosen}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", action="append", help=f"TOPOLOGY:N:RATE (default: {' '.join(CONFIGS)})")
    ap.add_argument("--shapes", help="comma-separated suite names (default: all)")
    ap.add_argument("--forms", default=",".join(FORMS), help="comma-separated of 2d,3d,4d (default: all)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", help="also write every session as JSON lines to this file")
    ap.add_argument("--confirm", type=int, default=0, metavar="K",
                    help="then K rounds of one short session per form (its best and its baseline), back to back")
    args = ap.parse_args()
    wanted = set(args.shapes.split(",")) if args.shapes else None
    want_forms = [f for f in args.forms.split(",") if f]
    bad = [f for f in want_forms if f not in FORMS]
    if bad:
        print(f"error: unknown form {bad[0]!r} (known: {', '.join(FORMS)})", file=sys.stderr)
        return 2
    t = Table(title="overlap gap: best strategy per form, efficiency (T_base - T_win) / (T_base - T_bound)")
    cols = ["config", "shape", "regime", "form", "equation", "strategies", "comm ms", "comp ms", "bound ms",
            "baseline ms", "best ms", "IQR ms", "best", "eff", "vs 2d"]
    if args.confirm:
        cols += [f"2d's best, vs 2d ({args.confirm} rounds)", f"own best, vs 2d ({args.confirm} rounds)"]
    for col in cols:
        t.add_column(col, no_wrap=col in ("config", "best", "equation"))
    sink = open(args.json, "w") if args.json else None  # noqa: SIM115
    print(f"loadavg before: {open('/proc/loadavg').read().strip()}", file=sys.stderr)
    for cfg in args.config or CONFIGS:
        spec = LabSpec.parse(f"lab:{cfg}")
        t0 = time.time()
        with TargetSession(Target.parse(f"lab:{cfg}"), log=lambda m: print(m, file=sys.stderr)) as ts:
            for name, regime, p in suite(spec.n):
                if wanted and name not in wanted:
                    continue
                best_2d = None
                rows: list[list[str]] = []
                chosen: dict[str, tuple[Problem, object]] = {}
                for form, q in forms(p).items():
                    if form not in want_forms:
                        continue
                    strategies = space(q, ts.device)
                    print(f"[{cfg}] {name} {form}: {q.describe()}: {len(strategies)} strategies", file=sys.stderr)
                    s = run_session(ts.runner(q), q, strategies, reps=args.reps,
                                    log=lambda m: print(m, file=sys.stderr))
                    best = s.best()
                    if form == "2d":
                        best_2d = best.median_s
                    chosen[form] = (q, Strategy.from_dict(best.strategy))
                    rel = "-" if best_2d is None or best.median_s is None else f"{best.median_s / best_2d:.3f}"
                    rows.append([cfg, name, regime, form, q.equation, str(len(strategies)), ms(s.comm_s), ms(s.comp_s),
                                 ms(s.bound_s), ms(s.baseline.median_s), ms(best.median_s), ms(best.iqr_s), best.key,
                                 "-" if best.efficiency is None else f"{best.efficiency:.2f}", rel])
                    if sink:
                        sink.write(json.dumps({"config": cfg, "shape": name, "form": form, "session": s.to_dict()}) + "\n")
                        sink.flush()
                if args.confirm:
                    rounds = confirm(ts, chosen, args.confirm, args.reps, cfg, name)
                    for row in rows:
                        row.extend(rounds.get(row[3], ("-", "-")))
                    if sink:
                        sink.write(json.dumps({"config": cfg, "shape": name, "confirm": rounds}) + "\n")
                        sink.flush()
                for row in rows:
                    t.add_row(*row)
        print(f"[{cfg}] done in {time.time() - t0:.0f} s", file=sys.stderr)
    out.print(t)
    print(f"loadavg after: {open('/proc/loadavg').read().strip()} ({os.cpu_count()} cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

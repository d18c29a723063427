"""Do two runs of extract -> tune -> bench-model agree? (issue 40, `bench/same_plan_twice.sh`)

    python bench/compare_runs.py RUN1 RUN2

Each RUN is a folder with `tune.jsonl` (`autotuner tune --json`) and `bench.json`
(`autotuner bench-model --json`). Per problem, the two runs' winners (the baseline where nothing
cleared the rule's floor, "unresolved" where the rule said so), and a verdict. A run "tells two
strategies apart" where their speedup intervals in that run are disjoint; the baseline's interval
is its session's noise band [1 - A/A width, 1 + A/A width] (the rule's own floor: noise never wins).

- `same`: the same strategy won (the baseline counts).
- `within noise`: different winners, and at most one run tells them apart (the other's evidence
  does not decide between them: a problem at the edge of the noise, or two rings alike).
- `not sampled`: one run never measured the other run's winner (its search did not reach it), so
  it cannot contradict it; printed with what each run measured of both.
- `DIFFER`: each run tells the two winners apart: each contradicts the other.

Then the step: each run's bench-model speedup and interval, and whether each point lies inside
the other run's interval. Exit status 0 when no problem DIFFERs and the step speedups lie inside
each other's intervals, else 1. Reads files only (timing is in the runs).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from autotuner.strategy import Strategy

BASELINE = "baseline"


def _rows(run: Path) -> dict[str, dict[str, Any]]:
    rows = [json.loads(line) for line in (run / "tune.jsonl").read_text().splitlines() if line.strip()]
    return {r["key"]: r for r in rows}


def _winner(row: dict[str, Any]) -> str:
    return Strategy.from_dict(row["winner"]).key if row.get("winner") else BASELINE


def _interval(row: dict[str, Any], key: str) -> tuple[float, float] | None:
    """The latest measured speedup interval of strategy `key` in this run's row; the baseline's is
    its session's noise band (its A/A width around 1)."""
    if key == BASELINE:
        noise = row.get("aa_width") or 0.0
        return (1.0 - noise, 1.0 + noise)
    latest = {c["key"]: c for c in row.get("candidates", []) if c.get("status") == "ok"}
    c = latest.get(key)
    ci = c and c.get("speedup_ci")
    return (ci[0], ci[1]) if ci and None not in ci else None


def verdict(r1: dict[str, Any], r2: dict[str, Any], names: tuple[str, str] = ("run 1", "run 2")) -> tuple[str, str]:
    """(verdict, why) for one problem's rows in the two runs (called `names`)."""
    w1, w2 = _winner(r1), _winner(r2)
    if w1 == w2:
        return "same", ""
    told, why = 0, []
    for n, row in zip(names, (r1, r2), strict=True):
        a, b = _interval(row, w1), _interval(row, w2)
        if a is None or b is None:
            return "not sampled", f"{n} never measured {w1 if a is None else w2}"
        apart = a[0] > b[1] or b[0] > a[1]
        told += apart
        why.append(f"{n}: {w1} [{a[0]:.3f}, {a[1]:.3f}], {w2} [{b[0]:.3f}, {b[1]:.3f}]"
                   + (" apart" if apart else " overlap"))
    return ("DIFFER" if told == 2 else "within noise"), "; ".join(why)


def _fmt(row: dict[str, Any]) -> str:
    w = _winner(row)
    if w == BASELINE:
        return BASELINE + (" (unresolved)" if row.get("unresolved") else "")
    lo, hi = row["speedup_ci"]
    return f"{w} {row['speedup']:.3f}x [{lo:.3f}, {hi:.3f}]"


def main(run1: str, run2: str) -> int:
    a, b = Path(run1), Path(run2)
    rows1, rows2 = _rows(a), _rows(b)
    ok = True
    names = (a.name, b.name)
    print(f"{'problem':44} {names[0]:58} {names[1]:58} verdict")
    for key in sorted(set(rows1) | set(rows2), key=lambda k: (rows1.get(k) or rows2[k])["name"] or k):
        r1, r2 = rows1.get(key), rows2.get(key)
        name = ((r1 or r2) or {}).get("name") or key[:12]
        name = name if len(name) <= 44 else name[:30] + "…" + name[-13:]
        if r1 is None or r2 is None:
            print(f"{name:44} only in {names[0] if r2 is None else names[1]}")
            ok = False
            continue
        v, why = verdict(r1, r2, names)
        ok &= v != "DIFFER"
        print(f"{name:44} {_fmt(r1)[:58]:58} {_fmt(r2)[:58]:58} {v}" + (f"  ({why})" if why else ""))
    steps = [json.loads((run / "bench.json").read_text()) for run in (a, b)]
    for n, s in zip(names, steps, strict=True):
        share = s.get("overlap_share")
        print(f"step, {n}: plain {s['plain']['median_s'] * 1e3:.2f} ms, overlapped "
              f"{s['overlapped']['median_s'] * 1e3:.2f} ms, speedup {s['speedup']:.3f}x "
              f"[{s['speedup_lo']:.3f}, {s['speedup_hi']:.3f}]"
              + ("" if share is None else f", overlap explains {100 * share:.0f}% of the saving"))
    (s1, s2) = steps
    inside = (s2["speedup_lo"] <= s1["speedup"] <= s2["speedup_hi"]
              and s1["speedup_lo"] <= s2["speedup"] <= s1["speedup_hi"])
    print("step speedups " + ("lie inside each other's intervals" if inside else "do NOT lie inside each other's intervals"))
    ok &= inside
    print("the runs agree" if ok else "the runs DISAGREE")
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2]))

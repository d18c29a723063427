"""Benchmark: the calibrated cost model against measurement on the lab.

    python bench/costmodel.py --reps 11 --out /tmp/cm.jsonl      # calibrate + exhaustive, both configs
    python bench/costmodel.py --from /tmp/cm.jsonl --replay 10   # the tables again (no lab) + the replay
    python bench/costmodel.py --config shared:2:2gbit --reps 11 --tune --out /tmp/cm2.jsonl

Per config (default lab:shared:2:2gbit and lab:ring:4:1gbit): the cost model is calibrated on the
target (`costmodel.collect` + `fit`: synthetic shapes, not the suite's), then every strategy of
every suite shape is measured in one exhaustive session and compared with the prediction:

(a) Spearman rank correlation between predicted and measured (median) times, per shape, beside
    the session's own split-half reliability (odd vs even repetitions: how well the measurement
    ranks its own strategies, the ceiling for any model), and overall: pooled over all
    (shape, strategy) pairs, of the times and of the times divided by the shape's baseline;
(b) with --tune: the tuner (`search.tune_problem`, a fresh database per run) with and without
    `order=costmodel.ranker(...)`, on the same shapes (--tune-shapes), with a trial budget below
    the space size. From the order in which each run measured its strategies: the trials it
    needed to reach the optimum, "reached" meaning within --tol (3%) of the optimum's time in a
    final interleaved session of the baseline, the exhaustive pick and every strategy either run
    measured (0 when the baseline itself is within --tol: every batch measures it);
(c) with --replay SEEDS: the same comparison with the real tuner run SEEDS times per arm on the
    recorded exhaustive sessions (each repetition drawn from the measured samples), no lab.

Everything measured is written to --out (JSON lines), so --from reprints the tables (--refit: with
the calibration fitted again from the stored raw sweeps by this version of the model).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from autotuner import costmodel as cm
from autotuner.decompose.space import space
from autotuner.problem import Problem
from autotuner.problem.suite import suite
from autotuner.strategy import Strategy

CONFIGS = ["shared:2:2gbit", "ring:4:1gbit"]
out = Console(width=240, emoji=False)  # strategy keys unabridged when piped


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def spearman(a: list[float], b: list[float]) -> float:
    from scipy.stats import spearmanr

    if len(a) < 3:
        return math.nan
    r = spearmanr(a, b).statistic
    return float(r)


# ----------------------------------------------------------------------------------- measuring


def measure_config(cfg: str, shapes: set[str] | None, reps: int, tune: bool, trials: int | None,
                   seeds: list[int], tol: float, sink: Any, scale: float = 1.0, cal_reps: int = 7,
                   tune_shapes: set[str] | None = None, tune_reps: int = 7) -> dict[str, Any]:
    from autotuner.measure import run_session
    from autotuner.measure.targets import Target, TargetSession

    rec: dict[str, Any] = {"config": cfg, "shapes": [], "tune": []}
    text = cfg if cfg.split(":")[0] in ("inproc", "local", "lab") else f"lab:{cfg}"
    with TargetSession(Target.parse(text), log=log) as ts:
        t0 = time.perf_counter()
        raw = cm.collect(ts, reps=cal_reps, log=log)
        rec["calibration_s"] = time.perf_counter() - t0
        rec["raw"], rec["device"] = raw, ts.device.to_dict()
        Path(sink.name + ".partial").write_text(json.dumps(rec))
        params = cm.fit(raw)
        rec["params"] = params.to_dict()
        log(f"[{cfg}] calibrated in {rec['calibration_s']:.0f} s: {json.dumps(params.to_dict())}")
        for name, _regime, p in suite(ts.device.num_devices, scale=scale):
            if shapes and name not in shapes:
                continue
            strategies = space(p, ts.device)
            log(f"[{cfg}] {name}: exhaustive over {len(strategies)}")
            t1 = time.perf_counter()
            s = run_session(ts.runner(p), p, strategies, reps=reps, log=log)
            rec["shapes"].append({"shape": name, "problem": p.to_dict(), "session": s.to_dict(),
                                  "seconds": time.perf_counter() - t1})
            if tune and (tune_shapes is None or name in tune_shapes):
                rec["tune"].append(tune_shape(ts, cfg, name, p, s, params, trials, seeds, tune_reps, tol))
            Path(sink.name + ".partial").write_text(json.dumps(rec))  # survives a crash later on
    sink.write(json.dumps(rec) + "\n")
    sink.flush()
    return rec


def tune_shape(ts: Any, cfg: str, name: str, p: Problem, ex: Any, params: cm.Params, trials: int | None,
               seeds: list[int], reps: int, tol: float) -> dict[str, Any]:
    """Tuner runs with and without the model's order; the final interleaved check."""
    import optuna

    from autotuner.measure import run_session
    from autotuner.tune.search import study_name, tune_problem
    from db import Database, optuna_storage_url

    cands = [s for s in space(p, ts.device) if not s.is_baseline]
    budget = trials or max(4, len(cands) // 3)
    budget = min(budget, len(cands) - 1)  # below the space size, or tune_problem grids it all
    runs = []
    for arm in ("model", "none"):
        for seed in seeds:
            tmp = Path(tempfile.mkdtemp(prefix="cm-tune-"))
            url = f"sqlite:///{tmp / 'tune.db'}"
            database = Database(url)
            database.upgrade()
            order = cm.ranker(params, p) if arm == "model" else None
            t0 = time.perf_counter()
            res = tune_problem(ts, database, p, trials=budget, reps=reps, name=name, seed=seed, order=order,
                               use_model=False)
            study = optuna.load_study(study_name=study_name(ts.device, p), storage=optuna_storage_url(url))
            seq = [t.user_attrs["strategy_key"] for t in sorted(study.trials, key=lambda t: t.number)
                   if t.user_attrs.get("strategy_key") and t.user_attrs.get("measured", True)]
            seq = list(dict.fromkeys(seq))
            runs.append({"arm": arm, "seed": seed, "sequence": seq, "trials": res.trials,
                         "winner": res.winner.strategy_key if res.winner else "baseline",
                         "seconds": time.perf_counter() - t0})
            log(f"[{cfg}] {name}: tuner ({arm}, seed {seed}) measured {seq}")
            database.dispose()
    best = ex.best()
    keys = list(dict.fromkeys([best.key] + [k for r in runs for k in r["sequence"]]))
    by_key = {s.key: s for s in space(p, ts.device)}
    check = [Strategy.baseline()] + [by_key[k] for k in keys if k != "baseline"]
    log(f"[{cfg}] {name}: final check of {len(check)} strategies")
    fin = run_session(ts.runner(p), p, check, reps=11)
    times = {c.key: c.median_s for c in [fin.baseline, *fin.candidates] if c.status == "ok"}
    return {"shape": name, "budget": budget, "space": len(cands), "optimum": best.key, "runs": runs,
            "final": times, "tol": tol}


# ----------------------------------------------------------------------------------- replay


class ReplayRunner:
    """A Runner that answers with repetitions drawn from a recorded exhaustive session, so the
    real tuner (`tune_problem`, Optuna, pruning and all) can be run many times, for many seeds,
    on measured data."""

    def __init__(self, session: dict[str, Any], seed: int):
        import numpy as np

        self.rng = np.random.default_rng(seed)
        self.samples = {c["key"]: c["samples"] for c in [session["baseline"], *session["candidates"]]
                        if c["status"] == "ok" and c["samples"]}
        self.comm, self.comp = session.get("comm_s"), session.get("comp_s")

    def prepare(self, problem: Problem, strategies: list[Strategy], parts: bool = True) -> list[dict[str, Any]]:
        self.keys = [s.key for s in strategies]
        return [{"ok": k in self.samples, "reason": None if k in self.samples else "not measured",
                 "compile_s": 0.0, "memory": None, "rel_error": 0.0} for k in self.keys]

    def time(self, program: int | str) -> float:
        from autotuner.measure import COMM, COMP

        if program in (COMM, COMP):
            v = self.comm if program == COMM else self.comp
            if v is None:
                raise RuntimeError("no parts recorded")
            return float(v)
        return float(self.rng.choice(self.samples[self.keys[int(program)]]))


class ReplayTarget:
    def __init__(self, device: Any, session: dict[str, Any], seed: int):
        self.device, self.session, self.seed = device, session, seed

    def runner(self, problem: Problem) -> ReplayRunner:
        self.seed += 1
        return ReplayRunner(self.session, self.seed)


def replay(recs: list[dict[str, Any]], seeds: int, tol: float, trials: int | None) -> list[dict[str, Any]]:
    """The tuner with and without the model's order on recorded sessions; trials to the optimum."""
    import logging
    import shutil

    import optuna

    from autotuner.device import Device
    from autotuner.tune.search import study_name, tune_problem
    from db import Database, ensure_optuna_schema, optuna_storage_url

    logging.getLogger("autotuner.tune.search").setLevel(logging.WARNING)
    tmp = Path(tempfile.mkdtemp(prefix="cm-replay-"))
    template = tmp / "template.db"
    Database(f"sqlite:///{template}").upgrade()
    ensure_optuna_schema(f"sqlite:///{template}")
    storage = optuna.storages.RDBStorage(optuna_storage_url(f"sqlite:///{template}"))  # creates its tables
    storage.engine.dispose()
    optuna_template = Path(optuna_storage_url(f"sqlite:///{template}").removeprefix("sqlite:///"))
    rows = []
    for rec in recs:
        params = cm.Params.from_dict(rec["params"])
        device = Device.from_dict(rec["device"])
        for sh in rec["shapes"]:
            p = Problem.from_dict(sh["problem"])
            sess = sh["session"]
            meas = {c["key"]: c["median_s"] for c in [sess["baseline"], *sess["candidates"]]
                    if c["status"] == "ok" and c["median_s"]}
            best = min(meas.values())
            near = {k for k, v in meas.items() if v <= best * (1 + tol)}  # the baseline is trial 0
            cands = [s for s in space(p, device) if not s.is_baseline]
            budget = min(trials or max(4, len(cands) // 3), len(cands) - 1)
            got: dict[str, list[int | None]] = {"model": [], "none": []}
            for seed in range(seeds):
                for arm in ("model", "none"):
                    run = tmp / f"run-{arm}-{seed}"
                    run.mkdir()
                    url = f"sqlite:///{run / 'tune.db'}"
                    shutil.copy(template, run / "tune.db")
                    shutil.copy(optuna_template, Path(optuna_storage_url(url).removeprefix("sqlite:///")))
                    database = Database(url)
                    order = cm.ranker(params, p) if arm == "model" else None
                    tune_problem(ReplayTarget(device, sess, 1000 * seed), database, p, trials=budget, reps=5,
                                 seed=seed, order=order, use_model=False)
                    study = optuna.load_study(study_name=study_name(device, p), storage=optuna_storage_url(url))
                    seq = list(dict.fromkeys(t.user_attrs["strategy_key"] for t in sorted(study.trials, key=lambda t: t.number)
                                             if t.user_attrs.get("strategy_key") and t.user_attrs.get("measured", True)))
                    database.dispose()
                    shutil.rmtree(run)
                    got[arm].append(0 if "baseline" in near else
                                    next((i for i, k in enumerate(seq, 1) if k in near), None))
            rows.append({"config": rec["config"], "shape": sh["shape"], "space": len(cands), "budget": budget,
                         "near": sorted(near), "got": got})
            log(f"replay {rec['config']} {sh['shape']}: {got}")
    shutil.rmtree(tmp, ignore_errors=True)
    return rows


def report_replay(rows: list[dict[str, Any]], seeds: int, tol: float) -> None:
    t = Table(title=f"replay: the real tuner on the recorded exhaustive sessions ({seeds} seeds per arm; "
                    f"optimum = within {tol:.0%} of the best median); trials to reach it, '-' = not in budget")
    for col in ("config", "shape", "space", "budget", "near-optimal", "with model (per seed)", "mean",
                "without (per seed)", "mean", "reached w/ / w/o"):
        t.add_column(col)
    allm, alln = [], []
    for r in rows:
        b = r["budget"]
        vals = {a: [v if v is not None else b + 1 for v in r["got"][a]] for a in ("model", "none")}
        allm += vals["model"]
        alln += vals["none"]
        fmt = lambda vs: ",".join("-" if v is None else str(v) for v in vs)  # noqa: E731
        reached = {a: sum(v is not None for v in r["got"][a]) for a in ("model", "none")}
        t.add_row(r["config"], r["shape"], str(r["space"]), str(b), str(len(r["near"])), fmt(r["got"]["model"]),
                  f"{sum(vals['model']) / len(vals['model']):.1f}", fmt(r["got"]["none"]),
                  f"{sum(vals['none']) / len(vals['none']):.1f}",
                  f"{reached['model']}/{len(vals['model'])} vs {reached['none']}/{len(vals['none'])}")
    out.print(t)
    if allm:
        out.print(f"replay overall: mean trials to the optimum with the model {sum(allm) / len(allm):.2f}, "
                  f"without {sum(alln) / len(alln):.2f} ({len(allm)} runs each; not reached = budget + 1)")


# ----------------------------------------------------------------------------------- reporting


def split_half(cands: list[dict[str, Any]], keys: list[str]) -> float:
    """Spearman between the medians of the odd and of the even repetitions: how well the session
    ranks its own strategies (the ceiling for any model)."""
    import statistics

    by = {c["key"]: c["samples"] for c in cands}
    a = [statistics.median(by[k][0::2]) for k in keys if len(by[k]) >= 2]
    b = [statistics.median(by[k][1::2]) for k in keys if len(by[k]) >= 2]
    return spearman(a, b)


def report(recs: list[dict[str, Any]], tol: float) -> None:
    overall = Table(title="cost model vs measurement: Spearman rank correlation of predicted and measured "
                          "strategy times (exhaustive sessions)")
    for col in ("config", "shape", "strategies", "spearman", "split-half", "measured best", "ms", "model's pick",
                "its measured ms", "pick / best", "base ms", "pred base ms"):
        overall.add_column(col)
    pooled_p: list[float] = []
    pooled_m: list[float] = []
    raw_p: list[float] = []
    raw_m: list[float] = []
    halves_all: list[float] = []
    per_shape: list[float] = []
    for rec in recs:
        params = cm.Params.from_dict(rec["params"])
        device = rec.get("device")
        for sh in rec["shapes"]:
            p = Problem.from_dict(sh["problem"])
            sess = sh["session"]
            cands = [sess["baseline"], *sess["candidates"]]
            meas = {c["key"]: c["median_s"] for c in cands if c["status"] == "ok" and c["median_s"]}
            strategies = [Strategy.from_dict(c["strategy"]) for c in cands if c["key"] in meas]
            pred = cm.predict_all(p, strategies, params)
            keys = list(meas)
            r = spearman([pred[k] for k in keys], [meas[k] for k in keys])
            per_shape.append(r)
            halves = split_half(cands, keys)
            halves_all.append(halves)
            pooled_p += [pred[k] / pred["baseline"] for k in keys]
            pooled_m += [meas[k] / meas["baseline"] for k in keys]
            raw_p += [pred[k] for k in keys]
            raw_m += [meas[k] for k in keys]
            best = min(meas, key=meas.get)
            pick = min(pred, key=lambda k: (pred[k], k))
            overall.add_row(rec["config"], sh["shape"], str(len(keys)), f"{r:.3f}", f"{halves:.3f}", best,
                            f"{meas[best] * 1e3:.1f}",
                            pick, f"{meas[pick] * 1e3:.1f}", f"{meas[pick] / meas[best]:.3f}",
                            f"{meas['baseline'] * 1e3:.1f}", f"{pred['baseline'] * 1e3:.1f}")
        del device
    out.print(overall)
    finite = [r for r in per_shape if not math.isnan(r)]
    mean = sum(finite) / len(finite) if finite else math.nan
    pooled = spearman(pooled_p, pooled_m)
    hs = [h for h in halves_all if not math.isnan(h)]
    out.print(f"overall over {len(raw_p)} (shape, strategy) pairs of {len(finite)} shapes: Spearman of the times "
              f"{spearman(raw_p, raw_m):.3f}; of the times / the shape's baseline {pooled:.3f}; mean per-shape "
              f"{mean:.3f} (the sessions' own split-half mean {sum(hs) / max(len(hs), 1):.3f})")
    tunes = [(rec["config"], t) for rec in recs for t in rec.get("tune", [])]
    if tunes:
        report_tune(tunes, tol)


def trials_to_reach(seq: list[str], final: dict[str, float], optimum: str, tol: float) -> int | None:
    """1-based position of the first measured strategy within tol of the optimum (final check);
    0 when the baseline is within tol (every batch measures it)."""
    target = final.get(optimum)
    if target is None:
        return None
    if final.get("baseline", math.inf) <= target * (1 + tol):
        return 0  # the baseline is measured with every batch
    for i, k in enumerate(seq, 1):
        t = final.get(k)
        if t is not None and t <= target * (1 + tol):
            return i
    return None


def report_tune(tunes: list[tuple[str, dict[str, Any]]], tol: float) -> None:
    t = Table(title=f"trials the tuner needed to reach the exhaustive optimum (within {tol:.0%} in the final "
                    "interleaved check); '-' = not within its budget")
    for col in ("config", "shape", "space", "budget", "optimum", "with model", "without (per seed)",
                "model's first", "final ms: optimum / model's first"):
        t.add_column(col)
    sums = {"model": [], "none": []}
    for cfg, tu in tunes:
        final, opt = tu["final"], tu["optimum"]
        # "the optimum" is the fastest in the final check (the exhaustive pick's own session flatters it)
        opt = min(final, key=final.get)
        got: dict[str, list[int | None]] = {"model": [], "none": []}
        for r in tu["runs"]:
            got[r["arm"]].append(trials_to_reach(r["sequence"], final, opt, tol))
        for arm, vals in got.items():
            sums[arm] += [v if v is not None else tu["budget"] + 1 for v in vals]
        first = next((r["sequence"][0] for r in tu["runs"] if r["arm"] == "model" and r["sequence"]), "-")
        fmt = lambda vs: ", ".join("-" if v is None else str(v) for v in vs)  # noqa: E731
        t.add_row(cfg, tu["shape"], str(tu["space"]), str(tu["budget"]), opt, fmt(got["model"]), fmt(got["none"]),
                  first, f"{final[opt] * 1e3:.1f} / {final.get(first, math.nan) * 1e3:.1f}")
    out.print(t)
    for arm, vals in sums.items():
        if vals:
            out.print(f"{arm}: mean trials to the optimum {sum(vals) / len(vals):.2f} over {len(vals)} runs "
                      "(a run that never reached it counts budget + 1)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", action="append", help=f"lab TOPOLOGY:N:RATE, or inproc:N (default: "
                                                      f"{' '.join(CONFIGS)})")
    ap.add_argument("--shapes", help="comma-separated suite names (default: all)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--scale", type=float, default=1.0, help="size factor of the suite (1: the lab suite)")
    ap.add_argument("--cal-reps", type=int, default=7, help="repetitions per calibration program")
    ap.add_argument("--tune", action="store_true", help="also compare the tuner with and without the model")
    ap.add_argument("--tune-reps", type=int, default=7, help="repetitions per strategy in the tuner's sessions")
    ap.add_argument("--tune-shapes", help="comma-separated shapes to tune (default: every measured one)")
    ap.add_argument("--trials", type=int, help="tuner budget (default: a third of the space, below its size)")
    ap.add_argument("--seeds", default="0", help="comma-separated tuner seeds (each arm runs each)")
    ap.add_argument("--tol", type=float, default=0.03)
    ap.add_argument("--replay", type=int, default=0, metavar="SEEDS",
                    help="also run the real tuner SEEDS times per arm on the recorded sessions (no lab)")
    ap.add_argument("--out", help="write the measurements here (JSON lines)")
    ap.add_argument("--from", dest="source", help="read measurements from this file instead of measuring")
    ap.add_argument("--refit", action="store_true", help="with --from: fit the calibration sweeps again with "
                                                         "this version of the model instead of the stored fit")
    args = ap.parse_args()
    if args.source:
        recs = [json.loads(line) for line in Path(args.source).read_text().splitlines() if line.strip()]
        if args.config:
            recs = [r for r in recs if r["config"] in args.config]
        if args.refit:
            for r in recs:
                r["params"] = cm.fit(r["raw"]).to_dict()
        report(recs, args.tol)
        if args.replay:
            report_replay(replay(recs, args.replay, args.tol, args.trials), args.replay, args.tol)
        return 0
    shapes = set(args.shapes.split(",")) if args.shapes else None
    seeds = [int(s) for s in args.seeds.split(",")]
    path = args.out or tempfile.mktemp(prefix="costmodel-", suffix=".jsonl")
    recs = []
    with open(path, "a") as sink:
        for cfg in args.config or CONFIGS:
            recs.append(measure_config(cfg, shapes, args.reps, args.tune, args.trials, seeds, args.tol, sink,
                                       args.scale, args.cal_reps,
                                       set(args.tune_shapes.split(",")) if args.tune_shapes else None,
                                       args.tune_reps))
    log(f"measurements in {path}")
    report(recs, args.tol)
    if args.replay:
        report_replay(replay(recs, args.replay, args.tol, args.trials), args.replay, args.tol)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Fill a results database with N tuned problems (default 100k) for the load benchmark.

    python bench/fill_db.py --db /tmp/bench.db -n 100000

Problems are distinct, valid `autotuner.Problem`s from a few transformer-like layouts
(all-gather of either operand, reduce-scatter, batched), mesh sizes 2/4/8, float32 and
bfloat16, sizes drawn from a seeded generator (`problems(n, seed)` gives the same sequence to
`bench/load.py`). Each gets a baseline and two ring measurements with synthetic times; the
winner is chosen by the project's rule (`db.choose_winner`) from exactly those measurements.

Default: bulk inserts (a transaction per 5000 problems, multi-row INSERTs with explicit ids, so
run it while nothing else writes to the database) that keep
the repository's invariants: problem rows from `autotuner.tune.store.problem_values` with the log
features `repository.log_feature` gives, measurements as `record_measurements` would store them,
winners from `choose_winner`. `--via-repository` stores every problem with
`autotuner.tune.store.save` instead (the same data, about 30 times slower); the tests check both
give the same winners.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np

from autotuner import Device, Problem, Strategy
from autotuner.tune.store import device_values, problem_values

CHUNK = 5000
DTYPES = ("float32", "bfloat16")
MESH_SIZES = (2, 4, 8)
STRATEGIES = (Strategy("ring", "uni", 1, "full", "loop", True),
              Strategy("ring", "uni", 2, "full", "loop", True))


def bench_device() -> Device:
    """The fingerprint the generated records are stored under (and `bench/load.py` asks for)."""
    return Device(platform="cpu", device_kind="bench", num_devices=8, num_processes=8,
                  topology="bench-ring-1gbit", jax_version="0.10.2", jaxlib_version="0.10.2")


def _layout(kind: int, n: int, dtype: str, m: int, d: int, f: int, b: int) -> dict[str, Any]:
    mesh = {"x": n}
    if kind == 0:   # all_gather:lhs:free (column-parallel input)
        return {"equation": "md,df->mf", "lhs": {"shape": [m, d], "spec": ["x", None]},
                "rhs": {"shape": [d, f], "spec": [None, None]}, "out_spec": [None, None],
                "dtype": dtype, "mesh": mesh}
    if kind == 1:   # all_gather:rhs:free
        return {"equation": "md,df->mf", "lhs": {"shape": [m, d], "spec": [None, None]},
                "rhs": {"shape": [d, f], "spec": [None, "x"]}, "out_spec": [None, None],
                "dtype": dtype, "mesh": mesh}
    if kind == 2:   # reduce_scatter:free_lhs (row-parallel output)
        return {"equation": "md,df->mf", "lhs": {"shape": [m, d], "spec": [None, "x"]},
                "rhs": {"shape": [d, f], "spec": ["x", None]}, "out_spec": ["x", None],
                "dtype": dtype, "mesh": mesh}
    # batched all-gather, Megatron style (the DESIGN example's layout)
    return {"equation": "bsd,df->bsf", "lhs": {"shape": [b, m, d], "spec": [None, "x", None]},
            "rhs": {"shape": [d, f], "spec": [None, "x"]}, "out_spec": [None, None, "x"],
            "dtype": dtype, "mesh": mesh}


def problems(n: int, seed: int = 0) -> Iterator[Problem]:
    """``n`` distinct problems, always the same ones for the same seed."""
    rng = np.random.default_rng(seed)
    seen: set[str] = set()
    while len(seen) < n:
        kind = int(rng.integers(0, 4))
        size = int(rng.choice(MESH_SIZES))
        dtype = str(rng.choice(DTYPES))
        m, d, f = (64 * int(v) for v in rng.integers(1, 129, size=3))
        b = int(rng.choice([1, 2, 4, 8]))
        p = Problem.from_dict(_layout(kind, size, dtype, m, d, f, b))
        key = p.key
        if key in seen:
            continue
        seen.add(key)
        yield p


def _quantile(xs: list[float], q: float) -> float:
    """numpy's default (linear) quantile of sorted ``xs``."""
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def measurement_items(p: Problem, rng: np.random.Generator) -> list[dict[str, Any]]:
    """A baseline and two ring strategies with synthetic, plausible times (seconds)."""
    f = p.features()
    base = f["flops"] / 2e11 + f["comm_bytes"] / 1.25e8 + 5e-5
    ratios = [1.0, *rng.uniform(0.75, 1.45, size=len(STRATEGIES)).tolist()]
    noise = rng.normal(1.0, 0.01, size=(len(ratios), 7)).clip(0.95, 1.05).tolist()
    items = []
    for strategy, ratio, jitter in zip((Strategy.baseline(), *STRATEGIES), ratios, noise, strict=True):
        samples = [base / ratio * x for x in jitter]
        ordered = sorted(samples)
        item: dict[str, Any] = {
            "strategy": strategy.to_dict(), "strategy_key": strategy.key, "status": "ok",
            "samples": samples, "median_s": _quantile(ordered, 0.5),
            "iqr_s": _quantile(ordered, 0.75) - _quantile(ordered, 0.25), "min_s": ordered[0],
            "n": len(samples), "run_id": "bench-fill", "host": "bench"}
        if not strategy.is_baseline:
            item.update(ratio=ratio, ratio_lo=ratio - 0.04, ratio_hi=ratio + 0.04)
        items.append(item)
    return items


def _fill_repository(database: Any, device: Device, todo: list[Problem], seed: int) -> None:
    from autotuner.tune import store

    rng = np.random.default_rng(seed + 1)
    for p in todo:
        store.save(database, device, p, measurement_items(p, rng))


def _fill_bulk(database: Any, device: Device, todo: list[Problem], seed: int,
               log: Any = None) -> None:
    from sqlalchemy import func, insert, select, text

    from db import MeasurementRecord, choose_winner
    from db import repository as repo
    from db.tables import Measurement as MeasurementRow
    from db.tables import Problem as ProblemRow
    from db.tables import Winner as WinnerRow

    rng = np.random.default_rng(seed + 1)
    with database.session() as s:
        device_id = repo.upsert_device(s, **device_values(device)).id
    t0 = datetime.now(UTC)
    for lo in range(0, len(todo), CHUNK):
        chunk = todo[lo:lo + CHUNK]
        now = t0 + timedelta(microseconds=lo)  # distinct, increasing timestamps
        prows = []
        for p in chunk:
            v = problem_values(p)
            v.update({f"l{c}": repo.log_feature(v[c]) for c in "mnkb"}, created_at=now)
            prows.append(v)
        items = [measurement_items(p, rng) for p in chunk]
        with database.session() as s:
            # explicit ids (max + 1, ...): multi-row INSERTs without RETURNING are the fast path
            pid0 = s.execute(select(func.max(ProblemRow.id))).scalar_one() or 0
            mid0 = s.execute(select(func.max(MeasurementRow.id))).scalar_one() or 0
            pids = [pid0 + 1 + i for i in range(len(prows))]
            for pid, v in zip(pids, prows, strict=True):
                v["id"] = pid
            s.execute(insert(ProblemRow.__table__), prows)
            mrows = []
            for pid, its in zip(pids, items, strict=True):
                for it in its:
                    mrows.append({**it, "id": mid0 + 1 + len(mrows), "problem_id": pid,
                                  "device_id": device_id, "method": it["strategy"]["method"],
                                  "reason": None, "compile_s": None, "memory": None,
                                  "ratio": it.get("ratio"), "ratio_lo": it.get("ratio_lo"),
                                  "ratio_hi": it.get("ratio_hi"), "source": "tuned", "token_id": None,
                                  "created_at": now})
            s.execute(insert(MeasurementRow.__table__), mrows)
            mids = [r["id"] for r in mrows]
            wrows = []
            j = 0
            for pid, its in zip(pids, items, strict=True):
                records = []
                for _ in its:
                    r = mrows[j]
                    records.append(MeasurementRecord(
                        id=mids[j], problem_id=pid, device_id=device_id, strategy=r["strategy"],
                        strategy_key=r["strategy_key"], method=r["method"], status=r["status"],
                        reason=None, samples=tuple(r["samples"]), median_s=r["median_s"], iqr_s=r["iqr_s"],
                        min_s=r["min_s"], n=r["n"], ratio=r["ratio"], ratio_lo=r["ratio_lo"],
                        ratio_hi=r["ratio_hi"], aa_width=None, compile_s=None, memory=None, run_id=r["run_id"],
                        host=r["host"], serial_s=None, traffic_speedup=None, source="tuned", token_id=None,
                        created_at=now))
                    j += 1
                c = choose_winner(records)
                if c is None:
                    continue
                wrows.append({"device_id": device_id, "problem_id": pid, "strategy": c.strategy,
                              "strategy_key": c.strategy_key, "method": c.method, "speedup": c.speedup,
                              "speedup_lo": c.speedup_lo, "speedup_hi": c.speedup_hi,
                              "baseline_s": c.baseline_s, "winner_s": c.winner_s,
                              "measurement_ids": list(c.measurement_ids), "trials": c.trials,
                              "created_at": now, "updated_at": now})
            s.execute(insert(WinnerRow.__table__), wrows)
            repo.note_change(s, device.key)  # running services drop their answers for the device
            if database.dialect == "postgresql":  # the sequences must know the explicit ids
                for table in ("problems", "measurements", "winners"):
                    s.execute(text(f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), "
                                   f"(SELECT max(id) FROM {table}))"))
        if log is not None:
            log(f"  {lo + len(chunk)}/{len(todo)} problems")


def fill(database: Any, n: int, *, seed: int = 0, device: Device | None = None,
         via_repository: bool = False, log: Any = None) -> int:
    """Store the first ``n`` problems of ``problems(n, seed)`` that are not stored yet; returns
    how many were added."""
    from db import repository as repo

    device = device or bench_device()
    wanted = list(problems(n, seed))
    with database.session(read_only=True) as s:
        have = {p.key for p in wanted if repo.get_problem_by_key(s, p.key) is not None} \
            if _count_problems(s) else set()
    todo = [p for p in wanted if p.key not in have]
    if via_repository:
        _fill_repository(database, device, todo, seed)
    else:
        _fill_bulk(database, device, todo, seed, log)
    return len(todo)


def _count_problems(s: Any) -> int:
    from db import repository as repo

    return repo.list_problems(s, tuned_only=False, limit=1).total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", required=True, help="database URL or SQLite file (migrated to head)")
    ap.add_argument("-n", type=int, default=100_000, help="tuned problems to store (default 100000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--via-repository", action="store_true",
                    help="store through autotuner.tune.store.save (slow; the reference path)")
    args = ap.parse_args(argv)

    from db import Database

    database = Database(args.db)
    database.upgrade()  # a benchmark database: migrate it to this code's schema
    t0 = time.perf_counter()
    added = fill(database, args.n, seed=args.seed, via_repository=args.via_repository,
                 log=lambda m: print(m, file=sys.stderr))
    dt = time.perf_counter() - t0
    print(f"added {added} tuned problems ({args.n} wanted) to {database!r} in {dt:.1f} s "
          f"({added / dt if dt else 0:.0f}/s); device key {bench_device().key}", file=sys.stderr)
    database.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())

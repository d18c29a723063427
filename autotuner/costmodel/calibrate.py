"""Calibration: measure synthetic problems through the ordinary harness and fit `Params`."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from autotuner.costmodel.params import CostModelError, Params
from autotuner.costmodel.simulate import geometry, simulate
from autotuner.problem import Problem
from autotuner.strategy import Strategy

# ============================================================================ calibration


def _ag_problem(n: int, rows: int, k: int, cols: int, dtype: str = "float32") -> Problem:
    """all-gather of the lhs rows: block rows x k per device, einsum with a k x cols shard."""
    return Problem.from_dict({"equation": "sd,df->sf", "lhs": {"shape": [n * rows, k], "spec": ["x", None]},
                              "rhs": {"shape": [k, n * cols], "spec": [None, "x"]}, "out_spec": [None, "x"],
                              "dtype": dtype, "mesh": {"x": n}})


def _rs_problem(n: int, rows: int, f: int, d: int, dtype: str = "float32") -> Problem:
    """reduce-scatter of a rows x d output block per device, contracting f per device."""
    return Problem.from_dict({"equation": "sf,fd->sd", "lhs": {"shape": [n * rows, n * f], "spec": [None, "x"]},
                              "rhs": {"shape": [n * f, d], "spec": ["x", None]}, "out_spec": ["x", None],
                              "dtype": dtype, "mesh": {"x": n}})


def _mm_problem(n: int, m: int, k: int, cols: int, dtype: str = "float32") -> Problem:
    """A local einsum m x k x cols on every device at once (no collective)."""
    return Problem.from_dict({"equation": "sd,df->sf", "lhs": {"shape": [n * m, k], "spec": ["x", None]},
                              "rhs": {"shape": [k, cols], "spec": [None, None]}, "out_spec": ["x", None],
                              "dtype": dtype, "mesh": {"x": n}})


MM_SWEEP = [(128, 1024, 256), (256, 1024, 256), (256, 1024, 768), (512, 1024, 512), (512, 512, 2048),
            (1024, 1024, 768), (1024, 2048, 1024), (2048, 1024, 1024), (2048, 1024, 2048)]
X_SWEEP = [256, 1024, 2048, 4096]   # rows of a 256-column float32 block: 256 KiB to 4 MiB


def _ring(direction: str = "uni", chunks: int = 1, unroll: int | str = "full", fuse: str = "loop",
          send_first: bool = True) -> Strategy:
    return Strategy("ring", direction, chunks, unroll, fuse, send_first)  # type: ignore[arg-type]


def _valid(problem: Problem, strategies: Sequence[Strategy]) -> list[Strategy]:
    from autotuner.decompose.space import space

    ok = {s.key for s in space(problem)}
    return [Strategy.baseline()] + list(dict.fromkeys(s for s in strategies if s.key in ok and not s.is_baseline))


def _overlap_strategies(problem: Problem) -> list[Strategy]:
    """A spread of the space for fitting kappa, the loop overhead and the copy rate."""
    out = [_ring("uni", c, u, f) for c in (1, 2, 4) for u in ("full", 1) for f in ("loop", "after")]
    out += [_ring("uni", 2, "full", "loop", False), _ring("uni", 1, 2, "loop")]
    out += [_ring("bidi", c, "full", f) for c in (1, 2) for f in ("loop", "after")]
    if problem.pattern.kind == "reduce_scatter":
        out = [s for s in out if s.fuse == "loop"]
    return _valid(problem, out)


def _session(ts: Any, kind: str, problem: Problem, strategies: Sequence[Strategy], reps: int,
             log: Callable[[str], None]) -> dict[str, Any]:
    from autotuner.measure import run_session

    res = run_session(ts.runner(problem), problem, strategies, reps=reps)
    times = {c.key: c.median_s for c in [res.baseline, *res.candidates] if c.status == "ok"}
    failed = {c.key: c.reason for c in [res.baseline, *res.candidates] if c.status != "ok"}
    log(f"calibrate: {kind} {problem.describe()}: "
        + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in times.items())
        + (f"; comm {res.comm_s * 1e3:.1f} ms, comp {res.comp_s * 1e3:.1f} ms" if res.comm_s else ""))
    return {"kind": kind, "problem": problem.to_dict(), "times": times, "failed": failed,
            "strategies": {c.key: c.strategy for c in [res.baseline, *res.candidates]},
            "comm_s": res.comm_s, "comp_s": res.comp_s}


def collect(ts: Any, *, reps: int = 5, log: Callable[[str], None] | None = None,
            overlap: bool = True) -> dict[str, Any]:
    """Run the calibration sweeps on an open target session; the raw medians (`fit` reads them)."""
    log = log or (lambda _m: None)
    n = ts.device.num_devices
    raw: dict[str, Any] = {"n": n, "device": ts.device.to_dict(), "sessions": []}
    ss = raw["sessions"]
    for m, k, c in MM_SWEEP:
        ss.append(_session(ts, "mm", _mm_problem(n, m, k, c), [Strategy.baseline()], reps, log))
    if n > 1:
        for rows in X_SWEEP:
            p = _ag_problem(n, rows, 256, 1)
            ss.append(_session(ts, "x_ag", p, _valid(p, [_ring("uni", 1), _ring("uni", 2), _ring("uni", 4),
                                                          _ring("bidi", 1), _ring("bidi", 2)]), reps, log))
            p = _rs_problem(n, rows, 1, 256)
            ss.append(_session(ts, "x_rs", p, _valid(p, [_ring("uni", 1), _ring("bidi", 1)]), reps, log))
        if overlap:
            # balanced shapes and compute-heavy ones (einsum 3x the transfer), with shards of
            # the size real layers have (3 MiB): how much of the transfer hides, and what
            # chunking costs or gains, differs between the two, so both are in the fit
            base = fit(raw)
            for ratio in (1.0, 3.0):
                for kind in ("ag", "rs"):
                    p = _balanced(kind, n, base, inner=768, ratio=ratio)
                    ss.append(_session(ts, "overlap", p, _overlap_strategies(p), reps + 2, log))
    return raw


def _balanced(kind: str, n: int, params: Params, rows: int = 1024, inner: int = 512,
              ratio: float = 1.0) -> Problem:
    """A shape whose einsum per ring step takes about `ratio` times the step's transfer."""
    shard = rows * inner * 4.0
    want = ratio * params.t_x(shard) * (n - 1) / n  # per block
    lo, hi = 8, 8192
    while hi - lo > 8:
        mid = (lo + hi) // 2
        if params.t_mm(2.0 * rows * inner * mid) < want:
            lo = mid
        else:
            hi = mid
    cols = max(64, (lo + hi) // 2 // 64 * 64)
    if kind == "ag":
        return _ag_problem(n, rows, inner, cols)
    return _rs_problem(n, rows, cols, inner)


def _linear(xs: Sequence[Sequence[float]], ys: Sequence[float], *, nonneg: bool = True) -> list[float]:
    """Least squares of ys ~ xs @ coef (non-negative coefficients unless `nonneg` is False)."""
    import numpy as np
    from scipy.optimize import nnls

    a = np.asarray(xs, dtype=np.float64)
    b = np.asarray(ys, dtype=np.float64)
    scale = np.maximum(np.abs(a).max(axis=0), 1e-30)
    coef = nnls(a / scale, b)[0] if nonneg else np.linalg.lstsq(a / scale, b, rcond=None)[0]
    return [float(c) for c in coef / scale]


def fit(raw: dict[str, Any]) -> Params:
    """Calibrated parameters from the raw sweeps of `collect`."""
    n = int(raw["n"])
    ss = raw["sessions"]
    mm = sorted((geometry(Problem.from_dict(s["problem"])).flops, s["times"]["baseline"])
                for s in ss if s["kind"] == "mm" and "baseline" in s["times"])
    if not mm:
        raise CostModelError("no matmul measurement: cannot calibrate")
    xs = [s for s in ss if s["kind"] == "x_ag"]
    rss = [s for s in ss if s["kind"] == "x_rs"]
    # memory floor: the skinny einsums of the transfer sweep are memory-bound
    mem = [(geometry(p).in_bytes + geometry(p).out_bytes) / s["comp_s"]
           for s in xs if s.get("comp_s") for p in [Problem.from_dict(s["problem"])]]
    params = Params(mm=tuple(mm), mem_bw=max(mem) if mem else 1e10, mm_fit=(),
                    ag=(0.0, 0.0), rs=(0.0, 0.0), alpha=0.0, beta_uni=0.0, beta_bidi=0.0, num_devices=n)
    if n == 1 or not xs:
        return params
    # the collectives alone: a + b * bytes, a free (a shaper's burst lets the first bytes through
    # unshaped: a negative intercept)
    ag = _linear([[1.0, geometry(Problem.from_dict(s["problem"])).comm_bytes] for s in xs if s.get("comm_s")],
                 [s["comm_s"] for s in xs if s.get("comm_s")], nonneg=False)
    rs = _linear([[1.0, geometry(Problem.from_dict(s["problem"])).comm_bytes] for s in rss if s.get("comm_s")],
                 [s["comm_s"] for s in rss if s.get("comm_s")], nonneg=False) if any(s.get("comm_s") for s in rss) else ag
    params = replace(params, ag=(ag[0], ag[1]), rs=(rs[0], rs[1]))
    params = _fit_p2p(params, xs)
    over = [s for s in ss if s["kind"] == "overlap"]
    if over:
        params = _fit_overlap(params, over + xs + rss)
    return params


def _fit_p2p(params: Params, sessions: Sequence[dict[str, Any]]) -> Params:
    """Latency and bandwidths from the all-gather rings of the transfer sweep (their einsums are
    negligible): alpha and beta_uni from the unidirectional rings of 1, 2 and 4 chunks, then
    beta_bidi from the bidirectional ones; least squares of log time through the schedule."""
    import numpy as np
    from scipy.optimize import minimize

    def cases(direction: str) -> list[tuple[Problem, Strategy, float]]:
        out = []
        for s in sessions:
            p = Problem.from_dict(s["problem"])
            for key, t in s["times"].items():
                st = _strategy(s, key)
                if not st.is_baseline and st.direction == direction and t:
                    out.append((p, st, math.log(t)))
        return out

    def loss(q: Params, cs: list[tuple[Problem, Strategy, float]]) -> float:
        return float(np.mean([(math.log(max(simulate(p, st, q), 1e-9)) - y) ** 2 for p, st, y in cs]))

    uni, bidi = cases("uni"), cases("bidi")
    if not uni:
        return params
    big = max(uni, key=lambda c: geometry(c[0]).shard_bytes)
    b0 = math.exp(big[2]) / max((params.num_devices - 1) * geometry(big[0]).shard_bytes, 1.0)
    at = lambda v: replace(params, alpha=math.exp(v[0]), beta_uni=math.exp(v[1]), beta_bidi=math.exp(v[1]))  # noqa: E731
    r = min((minimize(lambda v: loss(at(v), uni), [math.log(a), math.log(b0)], method="Nelder-Mead",
                      options={"maxiter": 300, "xatol": 1e-4, "fatol": 1e-9}) for a in (1e-4, 3e-3)),
            key=lambda r: r.fun)
    params = at(r.x)
    if bidi:
        atb = lambda v: replace(params, beta_bidi=math.exp(v[0]))  # noqa: E731
        rb = minimize(lambda v: loss(atb(v), bidi), [math.log(params.beta_uni * 1.5)], method="Nelder-Mead",
                      options={"maxiter": 200, "xatol": 1e-4, "fatol": 1e-9})
        params = atb(rb.x)
    return params


def _strategy(session: dict[str, Any], key: str) -> Strategy:
    return Strategy.from_dict(dict(session["strategies"][key]))


def _fit_overlap(params: Params, sessions: Sequence[dict[str, Any]]) -> Params:
    """What only the schedule shows, fitted by least squares of log time over the ring strategies
    of the calibration sessions (the transfer sweep and the overlap sessions): kappa, kappa_x,
    the loop and per-einsum overheads and the copy rate. Latency and bandwidths stay as their
    direct fits (letting this fit move them too made the predictions worse: it traded them
    against the contention terms)."""
    import numpy as np
    from scipy.optimize import minimize

    cases = []
    for s in sessions:
        p = Problem.from_dict(s["problem"])
        for key, t in s["times"].items():
            if key != "baseline" and t:
                cases.append((p, _strategy(s, key), math.log(t)))
    if not cases:
        return params
    geos = {id(p): geometry(p) for p, _, _ in cases}
    # searched in log space within physical bounds: kappa, kappa_x in [0, 4], loop and per-einsum
    # overheads in [1 us, 50 ms], copy rate in [0.1, 100] GB/s
    bounds = [(math.log(0.01), math.log(4.01)), (math.log(0.01), math.log(4.01)),
              (math.log(1e-6), math.log(0.05)), (math.log(1e-6), math.log(0.05)), (math.log(1e8), math.log(1e11))]

    def at(v: Sequence[float]) -> Params:
        w = [min(max(x, lo), hi) for x, (lo, hi) in zip(v, bounds, strict=True)]
        return replace(params, kappa=math.exp(w[0]) - 0.01, kappa_x=math.exp(w[1]) - 0.01,
                       loop_s=math.exp(w[2]), piece_s=math.exp(w[3]) - 1e-6, copy_bw=math.exp(w[4]))

    def loss(v: Sequence[float]) -> float:
        q = at(v)
        err = [math.log(max(simulate(p, st, q, geos[id(p)]), 1e-9)) - y for p, st, y in cases]
        return float(np.mean(np.square(err)))

    starts = [[math.log(k + 0.01), math.log(0.02), math.log(2e-4), math.log(1e-4), math.log(5e9)]
              for k in (0.0, 0.5)]
    fits = {}
    for serial in (False, True):  # do the target's rolled loops overlap their body's ops?
        params = replace(params, loop_serial=serial)
        fits[serial] = min((minimize(loss, x0, method="Nelder-Mead", bounds=bounds,
                                     options={"maxiter": 400, "xatol": 1e-3, "fatol": 1e-7}) for x0 in starts),
                           key=lambda r: r.fun)
    serial = bool(fits[True].fun < fits[False].fun)
    params = replace(params, loop_serial=serial)
    return replace(at(fits[serial].x), info={"fit_rmse_log": math.sqrt(fits[serial].fun), "fit_cases": len(cases),
                                             "rmse_loop_overlapping": math.sqrt(fits[False].fun),
                                             "rmse_loop_serial": math.sqrt(fits[True].fun)})


def calibrate(ts: Any, *, reps: int = 5, log: Callable[[str], None] | None = None
              ) -> tuple[Params, dict[str, Any]]:
    """Measure and fit on an open target session: (params, raw sweeps)."""
    raw = collect(ts, reps=reps, log=log)
    return fit(raw), raw

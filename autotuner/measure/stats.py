"""Statistics of a session: robust summaries, the paired bootstrap ratio CI, the bound, efficiency."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autotuner.strategy import CHUNKS


@dataclass(frozen=True)
class Summary:
    median: float
    iqr: float
    min: float
    n: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> Summary:
        a = np.asarray(samples, dtype=np.float64)
        if a.size == 0:
            return cls(math.nan, math.nan, math.nan, 0)
        q1, med, q3 = np.percentile(a, [25, 50, 75])
        return cls(float(med), float(q3 - q1), float(a.min()), int(a.size))


def ratio_ci(base: Sequence[float], cand: Sequence[float], *, level: float = 0.95,
             boot: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """median(base) / median(cand) with a bootstrap CI, resampling the paired repetitions."""
    b, c = np.asarray(base, np.float64), np.asarray(cand, np.float64)
    k = min(b.size, c.size)
    if k == 0:
        return math.nan, math.nan, math.nan
    b, c = b[:k], c[:k]
    point = float(np.median(b) / np.median(c))
    if k < 3:
        return point, math.nan, math.nan
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, k, size=(boot, k))
    rs = np.median(b[idx], axis=1) / np.median(c[idx], axis=1)
    lo, hi = np.percentile(rs, [100 * (1 - level) / 2, 100 * (1 + level) / 2])
    return point, float(lo), float(hi)


def diff_ci(base: Sequence[float], cand: Sequence[float], *, level: float = 0.95,
            boot: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """median(base) - median(cand) (seconds saved) with a bootstrap CI, resampling the paired
    repetitions as `ratio_ci` does."""
    b, c = np.asarray(base, np.float64), np.asarray(cand, np.float64)
    k = min(b.size, c.size)
    if k == 0:
        return math.nan, math.nan, math.nan
    b, c = b[:k], c[:k]
    point = float(np.median(b) - np.median(c))
    if k < 3:
        return point, math.nan, math.nan
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, k, size=(boot, k))
    ds = np.median(b[idx], axis=1) - np.median(c[idx], axis=1)
    lo, hi = np.percentile(ds, [100 * (1 - level) / 2, 100 * (1 + level) / 2])
    return point, float(lo), float(hi)


def bound(t_comm: float, t_comp: float, n: int, t_base: float | None = None) -> float:
    """What perfect overlap could reach, the lower of two estimates: the parts measured alone run
    side by side, max(T_comm, T_comp); and the baseline with its smaller part hidden,
    T_base - min(T_comm, T_comp). Each adds the pipeline's fill, the smaller of one ring step's
    transfer (T_comm/(n-1)) and one step's einsum (T_comp/n), at the finest chunking the space
    offers (a pipeline stage is a shard split in max(CHUNKS) pieces).

    The second estimate matters where the parts timed alone cost more than they do inside the
    baseline (T_base < T_comm + T_comp: a collective alone pays its own launch and barrier; on
    two shared cores the einsum alone gets both): there the first one sat just below T_base, and
    the efficiency divided by that small difference (1.79 on a 3-D MLP problem of
    bench/mlp_up_3d.json's kind, 0.51 and 0.61 in two other runs of it). It is not a physical
    bound and cannot be made one from these measurements: a decomposition changes its parts (a
    ring's transfers go to neighbours only, partial einsums fit caches), so it may beat both
    estimates; `efficiency` above 1 says so."""
    if n <= 1:
        return t_comp
    fill = min(t_comm / (n - 1), t_comp / n) / max(CHUNKS)
    parts = max(t_comm, t_comp) + fill
    return parts if t_base is None else min(parts, t_base - min(t_comm, t_comp) + fill)


def efficiency(t_base: float, t: float, t_bound: float) -> float | None:
    """(T_base - T) / (T_base - T_bound): 0 is no gain, 1 is perfect overlap by `bound`'s lower
    estimate. Above 1 the decomposition beat both estimates: its parts ran faster than the
    baseline's (on the lab's `ring` topology gloo's reduce-scatter took 115 ms where the whole
    ring decomposition took 82: its transfers go only to ring neighbours), not that the overlap
    beat physics. None where the bound leaves nothing to gain."""
    if not (t_base - t_bound) > 0 or math.isnan(t):
        return None
    return (t_base - t) / (t_base - t_bound)


def halfwidth(ratio: float | None, lo: float | None, hi: float | None) -> float | None:
    """The CI's half-width relative to its point, (hi - lo) / (2 ratio): 0.05 is "+/-5%"."""
    if ratio is None or lo is None or hi is None or not ratio > 0 or math.isnan(lo) or math.isnan(hi):
        return None
    return (hi - lo) / (2 * ratio)


def aa_width(lo: float | None, hi: float | None) -> float | None:
    """An A/A check's width: how far from 1.0 the CI of two copies of one program reaches,
    max(1 - lo, hi - 1). A speedup closer to 1 than this is indistinguishable from the session's
    noise; a CI that misses 1.0 (a bias between identical programs: order, placement) widens it
    to the far end."""
    if lo is None or hi is None or math.isnan(lo) or math.isnan(hi):
        return None
    return max(1.0 - lo, hi - 1.0, 0.0)


def aa_ok(lo: float | None, hi: float | None, tol: float = 0.05) -> bool:
    """The A/A check passes: the CI contains 1.0 and stays within +/-tol of it."""
    w = aa_width(lo, hi)
    return w is not None and lo is not None and hi is not None and lo <= 1.0 <= hi and w <= tol

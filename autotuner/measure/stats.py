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


def bound(t_comm: float, t_comp: float, n: int) -> float:
    """What perfect overlap could reach: max(T_comm, T_comp) plus the pipeline's fill, the smaller
    of one ring step's transfer (T_comm/(n-1)) and one step's einsum (T_comp/n), at the finest
    chunking the space offers (a pipeline stage is a shard split in max(CHUNKS) pieces)."""
    if n <= 1:
        return t_comp
    return max(t_comm, t_comp) + min(t_comm / (n - 1), t_comp / n) / max(CHUNKS)


def efficiency(t_base: float, t: float, t_bound: float) -> float | None:
    """(T_base - T) / (T_base - T_bound): 0 is no gain, 1 is perfect overlap. T_comm is the
    library's collective alone (gloo's, NCCL's), so a value above 1 means the ring's own
    transfers beat that collective (on the lab's `ring` topology gloo's reduce-scatter took 115 ms
    where the whole ring decomposition took 82: its transfers go only to ring neighbours), not
    that the overlap beat physics."""
    if not (t_base - t_bound) > 0 or math.isnan(t):
        return None
    return (t_base - t) / (t_base - t_bound)

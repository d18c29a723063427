"""Timing whole program steps: plain `jax.jit` against `overlap(fn)`, interleaved in one run.

`time_steps` runs the programs in turn, rotating which goes first every repetition (as the
tuner's sessions do), each call waited for (`block_until_ready`) and, on a multi-process mesh,
taken as the slowest process's time (`Sync`). `StepStats.of` summarises one program's samples:
median and a 95% bootstrap interval of the median; `compare` gives the speedup (plain median /
overlapped median) with the paired bootstrap interval of `stats.ratio_ci`. `pair_breakdown`
times each decomposed pair alone (its baseline, its strategy, the collective alone) with the
tuner's own harness, so a step's figure can be read against where its time goes. `rel_error`
checks the overlapped step's results against plain jit's before any of this. `attribute` turns
the samples of the step with one decomposed problem alone, and with the plan minus that problem
(timed interleaved with plain and the full plan), into each problem's saving in the program.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from autotuner.measure.session import NoSync, Sync, run_session
from autotuner.measure.stats import diff_ci, ratio_ci

__all__ = ["AttributionRow", "PairTiming", "StepBench", "StepStats", "Unit", "attribute", "compare",
           "decomposed_units", "median_ci", "overlap_share", "pair_breakdown", "rel_error", "time_steps"]


def median_ci(samples: Sequence[float], *, level: float = 0.95, boot: int = 2000,
              seed: int = 0) -> tuple[float, float, float]:
    """(median, lo, hi): the median and its bootstrap interval (nan bounds under 3 samples)."""
    a = np.asarray(samples, np.float64)
    if a.size == 0:
        return math.nan, math.nan, math.nan
    med = float(np.median(a))
    if a.size < 3:
        return med, math.nan, math.nan
    rng = np.random.default_rng(seed)
    meds = np.median(a[rng.integers(0, a.size, size=(boot, a.size))], axis=1)
    lo, hi = np.percentile(meds, [100 * (1 - level) / 2, 100 * (1 + level) / 2])
    return med, float(lo), float(hi)


def rel_error(plain: Any, overlapped: Any) -> float:
    """The worst relative error (max |diff| / max |plain|, per output) of `overlapped`'s results
    against `plain`'s (pytrees of arrays); computed on the devices, so it works across processes.
    inf when the two differ in structure or shape."""
    import jax
    import jax.numpy as jnp

    a_leaves, b_leaves = jax.tree.leaves(overlapped), jax.tree.leaves(plain)
    if len(a_leaves) != len(b_leaves):
        return float("inf")

    @jax.jit
    def rel(a: Any, b: Any) -> Any:
        a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
        return jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30)

    worst = 0.0
    for a, b in zip(a_leaves, b_leaves, strict=True):
        if getattr(a, "shape", None) != getattr(b, "shape", None):
            return float("inf")
        if getattr(b, "size", 1) == 0:
            continue
        r = rel(a, b)
        worst = max(worst, float(np.asarray(r.addressable_data(0) if hasattr(r, "addressable_data") else r)))
    return worst


@dataclass(frozen=True)
class StepStats:
    median_s: float
    lo_s: float
    hi_s: float
    n: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> StepStats:
        med, lo, hi = median_ci(samples)
        return cls(med, lo, hi, len(samples))


def time_steps(programs: Sequence[Callable[[], Any]], *, reps: int, warmup: int = 2,
               sync: Sync | None = None) -> list[list[float]]:
    """Seconds per call of each program (a thunk), `reps` each, interleaved; `warmup` untimed
    calls of each first (compiles and caches)."""
    import jax

    sync = sync or NoSync()
    for prog in programs:
        for _ in range(warmup):
            jax.block_until_ready(prog())
    samples: list[list[float]] = [[] for _ in programs]
    order = list(range(len(programs)))
    for r in range(reps):
        for i in order[r % len(order):] + order[: r % len(order)]:
            sync.barrier()
            t0 = time.perf_counter()
            jax.block_until_ready(programs[i]())
            samples[i].append(sync.max_over_processes(time.perf_counter() - t0))
    return samples


SERVED = "served"   # PairTiming.strategy of a pair whose dot reads another ring's kept gather


@dataclass
class PairTiming:
    """One decomposed (problem, strategy) of the step, timed alone; `count`: its runs per step."""

    names: list[str]
    key: str
    strategy: str
    count: int
    baseline_s: float | None = None      # the pair as plain jit (collective + einsum)
    strategy_s: float | None = None      # the decomposition
    comm_s: float | None = None          # the collective alone
    comp_s: float | None = None          # the einsum alone
    ratio: float | None = None
    ratio_lo: float | None = None
    ratio_hi: float | None = None
    failed: str | None = None

    @property
    def saved_s(self) -> float | None:
        """Predicted seconds saved per step: count x (baseline - decomposition); for a pair served
        by another ring's kept gather (strategy "served"), nothing of its own: plain jit runs that
        all-gather once for both dots too (a served pair exists because the gather's value is
        shared), so the owner's ring replaces the one collective (bench-model --attribute measured
        it: the served pairs' collectives alone never came back in the step)."""
        if self.strategy == SERVED:
            return 0.0
        if self.baseline_s is None or self.strategy_s is None:
            return None
        return self.count * (self.baseline_s - self.strategy_s)


@dataclass
class StepBench:
    plain: StepStats
    overlapped: StepStats
    speedup: float
    speedup_lo: float | None
    speedup_hi: float | None
    reps: int
    pairs: list[PairTiming] = field(default_factory=list)
    attribution: list[AttributionRow] | None = None
    profile: dict[str, Any] | None = None   # `bench-model --profile`: {"plain": StepProfile dict, "overlapped": ...}
    plain_samples: list[float] = field(default_factory=list)
    overlapped_samples: list[float] = field(default_factory=list)

    @property
    def slower(self) -> bool:
        """Overlapped slower than plain beyond the interval (its upper bound below 1)."""
        return self.speedup_hi is not None and self.speedup_hi < 1.0

    @property
    def comm_s(self) -> float | None:
        """Every timed pair's collective alone, per step (count x time): decomposed or not."""
        got = [p.count * p.comm_s for p in self.pairs if p.comm_s is not None]
        return sum(got) if got else None

    @property
    def decomposed_comm_s(self) -> float | None:
        """The decomposed pairs' collectives alone, per step."""
        got = [p.count * p.comm_s for p in self.pairs if p.comm_s is not None and p.strategy != "baseline"]
        return sum(got) if got else None

    @property
    def predicted_saved_s(self) -> float | None:
        got = [p.saved_s for p in self.pairs if p.saved_s is not None]
        return sum(got) if got else None

    @property
    def overlap_share(self) -> float | None:
        """The share of the step's saving that overlap explains: how much longer the overlapped
        step runs collectives beside compute than plain does, over what it saves per step (both
        from the profile's means, `bench-model --profile`); None without a profile or a saving."""
        return overlap_share((self.profile or {}).get("plain"), (self.profile or {}).get("overlapped"))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for name in ("plain", "overlapped"):   # where the step's time goes, from the profile
            prof = (self.profile or {}).get(name)
            d[name].update({k: prof[f"{m}_ms"] / 1e3 if prof else None for k, m in (
                ("collective_s", "collective"), ("compute_s", "compute"), ("side_by_side_s", "overlap"),
                ("idle_s", "idle"))})
        d["overlap_share"] = self.overlap_share
        d.update(slower=self.slower, comm_s=self.comm_s, decomposed_comm_s=self.decomposed_comm_s,
                 predicted_saved_s=self.predicted_saved_s,
                 pairs=[{**asdict(p), "saved_s": p.saved_s} for p in self.pairs])
        if self.attribution is not None:
            d.update(alone_sum_saved_s=sum(a.alone_saved_s for a in self.attribution),
                     without_sum_saved_s=sum(a.without_saved_s for a in self.attribution),
                     interaction_saved_s=self.interaction_saved_s, measured_saved_s=self.measured_saved_s)
        return d

    @property
    def interaction_saved_s(self) -> float | None:
        """What the problems save together beyond their savings alone, from the attribution's two
        sums: where a step's saving is each problem's own (a_i) plus one term per pair of problems
        (b_ij), alone_i = a_i and without_i = a_i + sum_j b_ij, so sum b_ij = (without - alone) / 2
        and the plan saves (alone + without) / 2. Measured figures only; None without attribution."""
        if not self.attribution:
            return None
        alone = sum(a.alone_saved_s for a in self.attribution)
        without = sum(a.without_saved_s for a in self.attribution)
        return (without - alone) / 2

    @property
    def measured_saved_s(self) -> float:
        """Seconds per step the plan saves: plain median minus overlapped median."""
        return self.plain.median_s - self.overlapped.median_s


def compare(plain: Sequence[float], overlapped: Sequence[float], reps: int) -> StepBench:
    sp, lo, hi = ratio_ci(plain, overlapped)
    return StepBench(StepStats.of(plain), StepStats.of(overlapped), sp,
                     None if math.isnan(lo) else lo, None if math.isnan(hi) else hi, reps,
                     plain_samples=list(plain), overlapped_samples=list(overlapped))


def pair_breakdown(plan: Any, runner_for: Callable[[Any], Any], *, reps: int,
                   log: Callable[[str], None] | None = None) -> list[PairTiming]:
    """Each distinct (problem, strategy) of the plan's pairs, timed alone in one interleaved
    session of the tuner's harness (`runner_for(problem)` gives its Runner): the decomposed ones
    against their baseline, the others (strategy `baseline`, or `served` where the dot reads
    another ring's kept gather, so its collective is gone) for their collective's share."""
    groups: dict[tuple[str, str], tuple[Any, Any, PairTiming]] = {}
    for r in plan:
        if r.problem is None:
            continue
        label = SERVED if r.served_by else r.strategy.key
        k = (r.problem.key, label)
        if k not in groups:
            groups[k] = (r.problem, r.strategy, PairTiming([], r.problem.key, label, 0))
        t = groups[k][2]
        t.names.append(r.name)
        if not r.member:   # a group runs once for all its dots
            t.count += r.count
    out = []
    for problem, strategy, t in groups.values():
        if log:
            log(f"timing {strategy.key} on {problem.describe()} alone")
        try:
            res = run_session(runner_for(problem), problem, [] if strategy.is_baseline else [strategy],
                              reps=reps, parts=True)
        except Exception as e:  # noqa: BLE001 - a breakdown row that failed says why
            t.failed = f"{type(e).__name__}: {e}"[:500]
            out.append(t)
            continue
        base, cands = res.baseline, res.candidates
        t.baseline_s, t.comm_s, t.comp_s = base.median_s, res.comm_s, res.comp_s
        if base.status != "ok":
            t.failed = base.reason
        elif strategy.is_baseline:
            pass
        elif cands and cands[0].status == "ok":
            c = cands[0]
            t.strategy_s, t.ratio, t.ratio_lo, t.ratio_hi = c.median_s, c.ratio, c.ratio_lo, c.ratio_hi
        else:
            t.failed = cands[0].reason if cands else "not timed"
        out.append(t)
    return out


# -- attribution: each decomposed problem's saving measured in the program ----------------------

@dataclass(frozen=True)
class Unit:
    """One decomposed problem of a plan, all its occurrences together (a group: once per run)."""

    key: str
    name: str
    count: int


def decomposed_units(plan: Any) -> list[Unit]:
    """The plan's decomposed problems in order of first appearance (rows with `problem`,
    `strategy`, `name`, `count`, `member`)."""
    units: dict[str, Unit] = {}
    for r in plan:
        if r.problem is None or not r.strategy.rewrites:
            continue
        k = r.problem.key
        u = units.get(k) or Unit(k, r.name, 0)
        units[k] = Unit(k, u.name, u.count + (0 if r.member else r.count))
    return list(units.values())


@dataclass(frozen=True)
class AttributionRow:
    key: str
    name: str
    count: int
    isolated_saved_s: float | None   # the pairs timed alone: count x (baseline - decomposition)
    alone_saved_s: float             # plain step - the step with only this problem decomposed
    alone_lo_s: float | None
    alone_hi_s: float | None
    without_saved_s: float           # the step without this problem - the full plan's step
    without_lo_s: float | None
    without_hi_s: float | None
    overlap_share: float | None = None   # with --profile: of its saving alone, what overlap explains


def overlap_share(before: dict[str, Any] | None, after: dict[str, Any] | None) -> float | None:
    """The share of a step's saving that overlap explains, from two `StepProfile` dicts (profile
    means): how much longer `after` runs collectives beside compute than `before` does, over the
    time per step it saves; None without both profiles or without a saving."""
    if not before or not after or before["step_ms"] - after["step_ms"] <= 0:
        return None
    return (after["overlap_ms"] - before["overlap_ms"]) / (before["step_ms"] - after["step_ms"])


def _or_none(x: float) -> float | None:
    return None if math.isnan(x) else x


def attribute(units: Sequence[Unit], plain: Sequence[float], full: Sequence[float],
              alone: Sequence[Sequence[float]], without: Sequence[Sequence[float]],
              pairs: Sequence[PairTiming] = ()) -> list[AttributionRow]:
    """Per unit: its saving alone in the step (plain - only it applied) and what removing it from
    the plan costs (the plan without it - the full plan), medians with paired 95% intervals (the
    programs were timed interleaved, repetition by repetition); `isolated_saved_s` from the
    decomposed pairs timed alone (`pair_breakdown`), where they were. No figure is scaled."""
    out = []
    for u, a, w in zip(units, alone, without, strict=True):
        sa, alo, ahi = diff_ci(plain, a)
        sw, wlo, whi = diff_ci(w, full)
        iso = [p.saved_s for p in pairs if p.key == u.key and p.strategy not in ("baseline", SERVED)
               and p.saved_s is not None]
        out.append(AttributionRow(u.key, u.name, u.count, sum(iso) if iso else None, sa, _or_none(alo),
                                  _or_none(ahi), sw, _or_none(wlo), _or_none(whi)))
    return out

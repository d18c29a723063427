"""measure.steps: the step statistics and the interleaved timing loop."""

from __future__ import annotations

import math

import numpy as np

from autotuner.measure.steps import PairTiming, compare, median_ci, time_steps


def test_median_ci_brackets_the_median_and_narrows_with_more_samples():
    rng = np.random.default_rng(0)
    few, many = rng.normal(10, 1, 9), rng.normal(10, 1, 400)
    m, lo, hi = median_ci(few)
    assert lo <= m <= hi and m == float(np.median(few))
    m2, lo2, hi2 = median_ci(many)
    assert lo2 <= m2 <= hi2 and hi2 - lo2 < hi - lo
    assert all(math.isnan(x) for x in median_ci([1.0, 2.0])[1:]) and math.isnan(median_ci([])[0])


def test_compare_flags_only_a_slowdown_beyond_the_interval():
    rng = np.random.default_rng(1)
    base = list(rng.normal(10, 0.1, 30))
    faster = compare(base, [x / 1.5 for x in base], 30)
    assert abs(faster.speedup - 1.5) < 1e-9 and faster.speedup_lo > 1 and not faster.slower
    slower = compare(base, [x * 1.3 for x in base], 30)
    assert slower.speedup_hi < 1 and slower.slower
    same = compare(base, list(rng.permutation(base)), 30)
    assert same.speedup_lo < 1 < same.speedup_hi and not same.slower
    d = faster.to_dict()
    assert d["plain"]["n"] == 30 and d["slower"] is False and len(d["plain_samples"]) == 30


def test_pair_saving_and_step_sums():
    t = PairTiming(["a", "b"], "k", "ring", 3, baseline_s=2.0, strategy_s=1.5, comm_s=1.0, comp_s=0.8)
    assert t.saved_s == 1.5
    res = compare([5.0] * 3, [4.0] * 3, 3)
    plain = PairTiming(["d"], "k3", "baseline", 2, baseline_s=1.0, comm_s=0.5, comp_s=0.4)
    res.pairs = [t, PairTiming(["c"], "k2", "ring", 1, failed="boom"), plain]
    assert res.comm_s == 4.0 and res.decomposed_comm_s == 3.0 and res.predicted_saved_s == 1.5
    assert plain.saved_s is None


def test_time_steps_interleaves_and_counts():
    calls: list[int] = []

    def prog(i: int):
        return lambda: calls.append(i) or np.zeros(1)

    samples = time_steps([prog(0), prog(1)], reps=4, warmup=1)
    assert [len(s) for s in samples] == [4, 4] and all(x >= 0 for s in samples for x in s)
    assert calls[:2] == [0, 1] and calls[2:] == [0, 1, 1, 0, 0, 1, 1, 0]   # order rotates


def test_a_served_pair_saves_its_whole_collective():
    """A dot that reads another ring's kept gather no longer runs its collective: its predicted
    saving is that collective alone, and it counts among the decomposed pairs' collectives."""
    from autotuner.measure.steps import SERVED

    t = PairTiming(["w"], "k", SERVED, 2, baseline_s=1.0, comm_s=0.25, comp_s=0.7)
    res = compare([5.0] * 3, [4.0] * 3, 3)
    res.pairs = [t]
    assert t.saved_s == 0.5 and res.predicted_saved_s == 0.5 and res.decomposed_comm_s == 0.5

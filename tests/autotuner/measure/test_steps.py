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


def test_a_served_pair_saves_nothing_of_its_own():
    """A dot that reads another ring's kept gather shared that gather with the owner's dot in
    plain jit already: no saving of its own; its collective still counts among the decomposed
    pairs' collectives (the one the owner's ring replaces)."""
    from autotuner.measure.steps import SERVED

    t = PairTiming(["w"], "k", SERVED, 2, baseline_s=1.0, comm_s=0.25, comp_s=0.7)
    res = compare([5.0] * 3, [4.0] * 3, 3)
    res.pairs = [t]
    assert t.saved_s == 0.0 and res.predicted_saved_s == 0.0 and res.decomposed_comm_s == 0.5


def test_attribution_recovers_each_problems_known_saving(monkeypatch):
    """A step of two decomposed problems whose costs are known (a clock that each program
    advances by its cost, with a repetition-dependent drift that the interleaving cancels): A saves
    3 and B 1 alone, together 4. `time_steps` over plain, the plan and the variants (alone A,
    without A, alone B, without B, as bench-model orders them), then `attribute`, gives each
    problem's saving exactly, their sums and the measured saving, and the isolated prediction."""
    from autotuner.measure import steps
    from autotuner.measure.steps import Unit, attribute

    now = [0.0]
    monkeypatch.setattr(steps.time, "perf_counter", lambda: now[0])
    cost = {"plain": 10.0, "plan": 6.0, "alone A": 7.0, "without A": 9.0, "alone B": 9.0, "without B": 7.0}
    rep = [0]

    def prog(name: str):
        def run():
            rep[0] += 1
            now[0] += cost[name] + 0.001 * (rep[0] // 6)   # drift: the same for each program within a rep
            return np.zeros(1)
        return run

    plain, full, *variants = time_steps([prog(n) for n in cost], reps=9, warmup=1)
    units = [Unit("kA", "a", 2), Unit("kB", "b", 1)]
    pairs = [PairTiming(["a"], "kA", "ring", 2, baseline_s=1.0, strategy_s=0.5, comm_s=0.4, comp_s=0.6),
             PairTiming(["b"], "kB", "baseline", 1, baseline_s=1.0, comm_s=0.4, comp_s=0.6)]
    rows = attribute(units, plain, full, variants[0::2], variants[1::2], pairs)
    a, b = rows
    assert math.isclose(a.alone_saved_s, 3.0, abs_tol=0.01) and math.isclose(b.alone_saved_s, 1.0, abs_tol=0.01)
    assert math.isclose(a.without_saved_s, 3.0, abs_tol=0.01) and math.isclose(b.without_saved_s, 1.0, abs_tol=0.01)
    assert a.alone_lo_s <= a.alone_saved_s <= a.alone_hi_s and a.alone_hi_s - a.alone_lo_s < 0.1
    assert a.isolated_saved_s == 1.0 and b.isolated_saved_s is None   # B's pair was not decomposed alone
    res = compare(plain, full, 9)
    res.attribution = rows
    d = res.to_dict()
    assert math.isclose(d["measured_saved_s"], 4.0, abs_tol=0.01)
    assert math.isclose(d["alone_sum_saved_s"], 4.0, abs_tol=0.02) and d["attribution"][0]["key"] == "kA"


def test_the_interaction_of_problems_is_what_the_sums_leave():
    """Two problems that save more together (5) than alone (2 + 1): the pairwise term the two sums
    give, (without - alone) / 2 = 2, is what the alone sum misses of the measured saving."""
    from autotuner.measure.steps import Unit, attribute

    cost = {"plain": 10.0, "plan": 5.0, "alone A": 8.0, "without A": 9.0, "alone B": 9.0, "without B": 8.0}
    series = {k: [v + 0.01 * i for i in range(7)] for k, v in cost.items()}
    rows = attribute([Unit("kA", "a", 1), Unit("kB", "b", 1)], series["plain"], series["plan"],
                     [series["alone A"], series["alone B"]], [series["without A"], series["without B"]])
    res = compare(series["plain"], series["plan"], 7)
    assert res.interaction_saved_s is None
    res.attribution = rows
    assert math.isclose(sum(r.alone_saved_s for r in rows), 3.0, abs_tol=1e-9)
    assert math.isclose(sum(r.without_saved_s for r in rows), 7.0, abs_tol=1e-9)
    assert math.isclose(res.interaction_saved_s, 2.0, abs_tol=1e-9)
    assert math.isclose(res.to_dict()["interaction_saved_s"] + 3.0, res.measured_saved_s, abs_tol=1e-9)


def test_decomposed_units_count_a_group_once_per_run():
    from types import SimpleNamespace

    from autotuner.measure.steps import decomposed_units
    from autotuner.strategy import Strategy

    ring = Strategy(method="ring")
    p, g = SimpleNamespace(key="p"), SimpleNamespace(key="g")
    rows = [SimpleNamespace(problem=g, strategy=ring, name="q", count=2, member=0),
            SimpleNamespace(problem=g, strategy=ring, name="k", count=2, member=1),
            SimpleNamespace(problem=p, strategy=Strategy.baseline(), name="x", count=1, member=None),
            SimpleNamespace(problem=p, strategy=ring, name="y", count=3, member=None),
            SimpleNamespace(problem=None, strategy=ring, name="z", count=1, member=None)]
    assert [(u.key, u.name, u.count) for u in decomposed_units(rows)] == [("g", "q", 2), ("p", "y", 3)]

"""Measurement quality: the A/A check (the baseline entered twice) and adaptive repetitions.

The sessions run on real in-process devices with small shapes; the assertions are on what the
harness does (which programs it times, when it stops and why), never on how fast anything ran.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from autotuner import Problem, Strategy, space
from autotuner.measure import (
    AA_KEY,
    LocalRunner,
    Precision,
    aa_ok,
    aa_width,
    halfwidth,
    ratio_ci,
    run_session,
)
from autotuner.measure.adaptive import BUDGET, CAP, DECIDED, NONE_LEFT, TARGET, decide

PROBLEM = {"equation": "sd,df->sf", "lhs": {"shape": [128, 64], "spec": ["x", None]},
           "rhs": {"shape": [64, 128], "spec": [None, "x"]}, "out_spec": [None, "x"],
           "dtype": "float32", "mesh": {"x": 4}}
STOPS = {TARGET, DECIDED, BUDGET, CAP}


def runner() -> LocalRunner:
    return LocalRunner(jax.make_mesh((4,), ("x",), devices=jax.devices()[:4]), warmup=1)


# -- the pure parts -----------------------------------------------------------------------------

def test_aa_width_is_the_reach_of_the_ci_from_one():
    assert aa_width(0.97, 1.02) == pytest.approx(0.03)
    assert aa_width(0.99, 1.04) == pytest.approx(0.04)
    assert aa_width(1.06, 1.08) == pytest.approx(0.08)  # a biased A/A: the far end counts
    assert aa_width(None, 1.0) is None and aa_width(float("nan"), 1.0) is None
    assert aa_ok(0.97, 1.02) and aa_ok(0.951, 1.049)
    assert not aa_ok(0.93, 1.02)            # wider than +/-5%
    assert not aa_ok(1.01, 1.03)            # narrow, but misses 1.0: the harness is biased
    assert aa_ok(0.93, 1.02, tol=0.1)
    assert halfwidth(1.2, 1.14, 1.26) == pytest.approx(0.05)
    assert halfwidth(1.0, None, 1.1) is None


def test_precision_rejects_nonsense():
    with pytest.raises(ValueError, match="fraction"):
        Precision(target=5)
    assert not Precision(target=0).on and not Precision(seconds=0).on and Precision().on


def noisy(center: float, spread: float, n: int, seed: int) -> np.ndarray:
    return center * (1 + np.random.default_rng(seed).normal(0, spread, n))


def test_decide_stops_when_the_leaders_ci_is_narrow():
    base = noisy(10.0, 0.01, 30, 0)
    d = decide(base, {1: noisy(8.0, 0.01, 30, 1), 2: noisy(9.0, 0.01, 30, 2)}, Precision())
    assert d.stop == TARGET and d.leader == 1 and d.leader_halfwidth <= 0.05


def test_decide_goes_on_with_the_leader_and_its_rivals_only():
    base = noisy(10.0, 0.3, 8, 0)
    cands = {1: noisy(8.0, 0.3, 8, 1), 2: noisy(8.2, 0.3, 8, 2), 3: noisy(30.0, 0.01, 8, 3)}
    d = decide(base, cands, Precision())
    assert d.stop is None and d.leader_halfwidth > 0.05
    assert d.leader in d.keep and 3 not in d.keep      # clearly beaten: not timed any more
    _, lo_lead, _ = ratio_ci(base, cands[d.leader])
    for i in d.keep:
        assert ratio_ci(base, cands[i])[2] >= lo_lead  # every one kept overlaps the leader's CI
    d1 = decide(base, cands, Precision(keep=1))
    assert d1.keep == (d1.leader,)


def test_decide_stops_when_every_candidate_is_surely_slower():
    base = noisy(10.0, 0.3, 8, 0)
    slow = {1: noisy(20.0, 0.3, 8, 1), 2: noisy(25.0, 0.3, 8, 2)}
    assert decide(base, slow, Precision()).stop == DECIDED
    assert decide(base, {}, Precision()).stop == NONE_LEFT


def test_an_aa_session_stops_when_the_check_would_pass():
    base = noisy(10.0, 0.01, 40, 0)
    same = {9: noisy(10.0, 0.01, 40, 1)}
    biased = {9: noisy(10.8, 0.01, 40, 1)}   # narrow, but 0.93: never "decided", never passes
    assert decide(base, same, Precision(), aa=True).stop == TARGET
    assert decide(base, biased, Precision(), aa=True).stop is None
    assert decide(base, biased, Precision()).stop == DECIDED


# -- real sessions ------------------------------------------------------------------------------

def test_aa_twin_is_compiled_and_timed_like_a_candidate_but_never_one():
    p = Problem.from_dict(PROBLEM)
    strategies = space(p)[:3]
    s = run_session(runner(), p, strategies, reps=4, aa=True)
    assert [c.key for c in s.candidates] == [x.key for x in strategies[1:]]
    twin = s.aa
    assert twin is not None and twin.key == AA_KEY and twin.strategy == Strategy.baseline().to_dict()
    assert twin.status == "ok" and twin.n == 4 and twin.compile_s > 0 and twin.error <= 1e-6
    assert twin.ratio_lo <= twin.ratio <= twin.ratio_hi
    assert s.aa_width == aa_width(twin.ratio_lo, twin.ratio_hi) and s.aa_width >= 0
    assert all(c.aa_width == s.aa_width for c in [s.baseline, *s.candidates])
    assert s.best().key != AA_KEY and s.to_dict()["aa"]["key"] == AA_KEY
    assert s.stop == "fixed" and s.reps == 4
    plain = run_session(runner(), p, strategies, reps=3)
    assert plain.aa is None and plain.aa_width is None and plain.baseline.aa_width is None


def test_adaptive_repetitions_stop_at_the_cap_or_a_decision():
    """An unreachable target: the session repeats until the cap unless the candidates are surely
    slower; the baseline and the twin are timed in every repetition, the others only while kept."""
    p = Problem.from_dict(PROBLEM)
    strategies = space(p)[:4]
    s = run_session(runner(), p, strategies, reps=3, aa=True,
                    precision=Precision(target=1e-9, seconds=600, max_reps=12))
    assert s.stop in (CAP, DECIDED)
    if s.stop == CAP:
        assert s.reps == 12
    else:
        assert all(c.ratio_hi < 1 for c in s.candidates if c.n == s.reps)
    assert s.baseline.n == s.reps and s.aa.n == s.reps
    assert all(3 <= c.n <= s.reps for c in s.candidates)
    assert s.comm_s is not None  # the parts are timed in the fixed repetitions only


def test_adaptive_repetitions_stop_at_once_when_the_target_is_met():
    # the decision: a leader whose CI is already within the target stops the session, no one kept
    d = decide([1.0, 1.01, 0.99, 1.0], {0: [0.5, 0.5, 0.51, 0.49], 1: [0.8, 0.81, 0.8, 0.79]},
               Precision(target=0.2))
    assert d.stop == TARGET and d.keep == () and d.leader == 0
    # a session with a loose target stops on it (or decided), not on the budget or the cap; how
    # many repetitions a noisy sub-millisecond einsum needs to get there is the machine's affair
    p = Problem.from_dict(PROBLEM)
    s = run_session(runner(), p, space(p)[:3], reps=4, precision=Precision(target=0.99, seconds=600))
    assert s.stop in (TARGET, DECIDED) and 4 <= s.reps < 200
    if s.stop == TARGET:
        lead = max(s.candidates, key=lambda c: c.ratio)
        assert halfwidth(lead.ratio, lead.ratio_lo, lead.ratio_hi) <= 0.99


def test_adaptive_repetitions_end_with_the_time_budget():
    p = Problem.from_dict(PROBLEM)
    s = run_session(runner(), p, [Strategy.baseline()], reps=3, aa=True,
                    precision=Precision(target=1e-9, seconds=0.5, max_reps=100000))
    assert s.stop == BUDGET and s.reps > 3     # an A/A session narrows the twin's CI itself
    assert s.baseline.n == s.aa.n == s.reps


class _Clock:
    """A runner with made-up times (no JAX): the harness's decisions on known samples. Program
    index -> (median seconds, relative noise); the noise is seeded, so every run is the same."""

    estimates = False

    def __init__(self, times: dict[int | str, tuple[float, float]]) -> None:
        self.times, self.rng, self.calls = times, np.random.default_rng(7), {}

    def prepare(self, problem, strategies, parts=True):
        return [{"ok": True, "reason": None, "compile_s": 0.0, "memory": None, "rel_error": 0.0}
                for _ in strategies]

    def time(self, program):
        self.calls[program] = self.calls.get(program, 0) + 1
        center, noise = self.times[program]
        return center * (1 + self.rng.normal(0, noise))


def test_the_other_reference_keeps_its_fixed_repetitions_and_does_not_hold_the_session_open():
    """Plain beside the baseline (as close to it as it usually is) is timed the fixed repetitions
    only: with every ring surely slower the session is decided then, not run to its budget for a
    choice between two programs that rewrite nothing."""
    p = Problem.from_dict(PROBLEM)
    ring = next(s for s in space(p) if s.method == "ring")
    clock = _Clock({0: (1.0, 0.02), 1: (2.0, 0.01), 2: (1.0, 0.02)})   # baseline, a slow ring, plain
    s = run_session(clock, p, [Strategy.baseline(), ring, Strategy.plain()], reps=5, parts=False,
                    precision=Precision(target=0.001, seconds=600))
    assert s.stop == DECIDED and s.reps == 5
    plain = next(c for c in s.candidates if c.key == "plain")
    assert plain.n == 5 and plain.ratio_lo is not None and plain.ratio_lo < 1 < plain.ratio_hi


def test_a_serial_control_is_timed_exactly_when_its_ring_is_and_never_leads():
    """Each ring's control rides along with it (the same repetitions, so `split`'s traffic x overlap
    is the ring's speedup from one set of samples); a control faster than every ring (made-up
    times) neither leads the session nor keeps it going, and the ring that falls behind takes
    its control with it."""
    from autotuner.measure.session import controls_of, split

    p = Problem.from_dict(PROBLEM)
    a, b = [s for s in space(p) if s.method == "ring"][:2]
    # baseline, ring a (the winner), ring b (slower), a's control, b's control (fastest of all)
    clock = _Clock({0: (1.0, 0.05), 1: (0.7, 0.05), 2: (0.95, 0.05), 3: (0.9, 0.05), 4: (0.4, 0.05)})
    s = run_session(clock, p, [Strategy.baseline(), a, b, a.serial(), b.serial()], reps=5, parts=False,
                    precision=Precision(target=0.02, seconds=600))
    ra, rb, ca, cb = s.candidates
    assert (ca.key, cb.key) == (a.serial().key, b.serial().key)
    assert s.stop and s.reps > 5 and ra.n == ca.n == s.reps and rb.n == cb.n < s.reps
    got = split(ra, controls_of(s.candidates).get(id(ra)))
    assert got["serial_s"] == ca.median_s
    assert abs(got["traffic_speedup"] * got["overlap_speedup"] - ra.ratio) < 1e-12
    assert 1.05 < got["traffic_speedup"] < 1.2 and 1.2 < got["overlap_speedup"] < 1.4

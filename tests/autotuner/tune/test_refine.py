"""tune.refine: choices tried in the step; a change kept only when the step's interval says so;
a stored unit is not timed again. The step is a rig whose cost per choice is known (the samples
are that cost plus a repetition's noise shared by every program of the repetition, as the
interleaving makes it)."""

from __future__ import annotations

from types import SimpleNamespace

from autotuner.strategy import Strategy
from autotuner.tune.refine import Evidence, RefineUnit, close_candidates, refine

RING1 = Strategy(method="ring", chunks=1)
RING2 = Strategy(method="ring", chunks=2)
BASE = Strategy.baseline()


class CostRig:
    """A step of 10 ms minus each problem's gain for its strategy; noise up to 0.3 ms per
    repetition, the same for every program of that repetition."""

    def __init__(self, gains: dict[str, dict[str, float]]) -> None:
        self.gains, self.choices, self.timed = gains, [], 0

    def cost(self, choice: dict[str, Strategy]) -> float:
        return 10.0 - sum(self.gains[k].get(s.key, 0.0) for k, s in choice.items())

    def variants(self, choices):
        self.choices = list(choices)
        return [{k for k, s in c.items() if not s.is_baseline} for c in choices]

    def time(self, reps):
        self.timed += 1
        noise = [0.3 * ((7 * r) % 5) / 4 for r in range(reps)]
        progs = [10.0, self.cost({})] + [self.cost(c) for c in self.choices]
        return [[p + n for n in noise] for p in progs]


def test_refinement_keeps_a_faster_choice_and_rejects_a_slower_one():
    # A: ring2 is 1 ms faster than ring1 in the step (alone they looked equal); B: baseline 0.5 ms slower
    rig = CostRig({"A": {RING1.key: 1.0, RING2.key: 2.0}, "B": {RING1.key: 0.5}})
    units = [RefineUnit("A", "a", 2, (RING2, BASE)), RefineUnit("B", "b", 1, (BASE,))]
    stored: list[Evidence] = []
    choice, evidence = refine(rig, units, {"A": RING1, "B": RING1}, reps=9, stored={}, store=stored.append)
    assert choice == {"A": RING2, "B": RING1}
    a, b = evidence
    assert a.changed and a.previous == RING1 and a.speedup_lo > 1
    assert [t["strategy_key"] for t in a.tried] == [RING2.key, BASE.key] and a.tried[1]["speedup_hi"] < 1
    assert not b.changed and b.speedup < 1 and b.speedup_hi < 1
    assert stored == evidence and rig.timed == 2
    # B was timed with A's new choice in place
    assert rig.choices[0] == {"A": RING2, "B": RING1}


def test_a_tie_keeps_the_current_choice():
    rig = CostRig({"A": {RING1.key: 1.0, RING2.key: 1.0}})
    choice, (ev,) = refine(rig, [RefineUnit("A", "a", 1, (RING2,))], {"A": RING1}, reps=9, stored={},
                           store=lambda e: None)
    assert choice == {"A": RING1} and not ev.changed and ev.speedup_lo <= 1 <= ev.speedup_hi


def test_refinement_resumes_without_timing_a_stored_unit():
    rig = CostRig({"A": {RING1.key: 1.0, RING2.key: 2.0}, "B": {RING1.key: 0.5}})
    units = [RefineUnit("A", "a", 2, (RING2, BASE)), RefineUnit("B", "b", 1, (BASE,))]
    done = Evidence("A", RING2, RING1, 1.1, 1.05, 1.15, 9)
    stored: list[Evidence] = []
    choice, evidence = refine(rig, units, {"A": RING1, "B": RING1}, reps=9, stored={"A": done},
                              store=stored.append)
    assert rig.timed == 1 and [e.problem_key for e in stored] == ["B"]   # only B measured and stored
    assert evidence[0] is done and choice == {"A": RING2, "B": RING1}


def test_close_candidates_follow_the_isolated_ranking():
    def m(s, ratio, lo, hi, status="ok"):
        return SimpleNamespace(status=status, strategy=s.to_dict(), ratio=ratio, ratio_lo=lo, ratio_hi=hi)

    ring4 = Strategy(method="ring", chunks=4)
    bi = Strategy(method="ring", direction="bidi")
    ms = [m(BASE, 1.0, 1.0, 1.0), m(RING1, 1.20, 1.10, 1.30), m(RING2, 1.15, 1.05, 1.25),
          m(ring4, 0.90, 0.85, 0.95), m(bi, 1.25, 1.00, 1.40, status="failed"), m(RING2, 1.12, 1.0, 1.2)]
    assert close_candidates(ms, RING1) == (RING2, BASE)          # ring4's interval misses 1.10
    assert close_candidates(ms, BASE) == (RING1, RING2)         # baseline: never itself
    assert close_candidates(ms, RING1, k=0) == (BASE,)

"""Adaptive repetitions: when to stop timing a session, and what to keep timing until then.

After a session's fixed repetitions, `run_session` keeps timing the baseline, the A/A twin (if
any) and the candidates that could still be the winner, one interleaved repetition at a time,
until the leader's speedup CI (against the baseline) is within +/-`target` of its point, every
candidate is surely slower than the baseline, or the time budget or the repetition cap ends. A
session of the baseline against itself alone (an A/A check) repeats until the check passes.
Pure decisions on the candidates' samples; the timing stays in `session`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autotuner.measure.stats import aa_ok, halfwidth, ratio_ci


@dataclass(frozen=True)
class Precision:
    """The knob: `target` the leader's CI half-width to reach (0.05 is +/-5%; 0 turns the
    adaptive phase off), `seconds` the time budget of the extra repetitions (per session),
    `max_reps` the cap on a session's repetitions, `keep` how many candidates besides the
    baseline and the twin are still timed (the leader and those whose CI overlaps its CI)."""

    target: float = 0.05
    seconds: float = 60.0
    max_reps: int = 200
    keep: int = 3

    def __post_init__(self) -> None:
        if not 0 <= self.target < 1:
            raise ValueError(f"precision target {self.target!r}: expected a fraction in [0, 1), e.g. 0.05")
        if self.seconds < 0 or self.max_reps < 1 or self.keep < 1:
            raise ValueError("precision: seconds >= 0, max_reps >= 1 and keep >= 1 are needed")

    @property
    def on(self) -> bool:
        return self.target > 0 and self.seconds > 0


# why a session stopped repeating (SessionResult.stop)
FIXED, TARGET, DECIDED, BUDGET, CAP, NONE_LEFT = "fixed", "target", "decided", "budget", "cap", "none left"


@dataclass(frozen=True)
class Decision:
    stop: str | None          # a reason above, or None: go on
    keep: tuple[int, ...]     # candidate indices to time in the next repetition
    leader: int | None
    leader_halfwidth: float | None


def decide(base: Sequence[float], cands: dict[int, Sequence[float]], precision: Precision, *,
           aa: bool = False) -> Decision:
    """One decision after a repetition. `base` is the baseline's samples, `cands` the samples of
    the candidates still being timed (index -> samples, paired with the baseline's by repetition).
    `aa=True`: `cands` is the baseline's A/A twin alone (a session of the baseline against
    itself), which stops when the A/A check would pass, its CI containing 1.0 within
    +/-target (`stats.aa_ok`), and never because it looks slower.
    """
    cis = {}
    for i, samples in cands.items():
        r, lo, hi = ratio_ci(base, samples)
        if lo == lo and hi == hi:  # not NaN: at least 3 paired repetitions
            cis[i] = (r, lo, hi)
    if not cis:
        return Decision(NONE_LEFT if not cands else None, tuple(cands), None, None)
    lead = max(cis, key=lambda i: (cis[i][0], cis[i][1], -i))
    r, lo, hi = cis[lead]
    hw = halfwidth(r, lo, hi)
    if aa:
        return Decision(TARGET if aa_ok(lo, hi, precision.target) else None, tuple(cis), lead, hw)
    if all(c[2] < 1.0 for c in cis.values()):
        return Decision(DECIDED, (), lead, hw)      # the baseline wins whatever more reps say
    if hw is not None and hw <= precision.target:
        return Decision(TARGET, (), lead, hw)
    rivals = sorted((i for i in cis if i != lead and cis[i][2] >= lo), key=lambda i: -cis[i][0])
    keep = [lead, *rivals][: precision.keep]
    # candidates without a CI yet (pruned late, failed reps) are not worth more time
    return Decision(None, tuple(sorted(keep)), lead, hw)

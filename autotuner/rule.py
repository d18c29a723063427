"""The winner rule, once: which measured strategy a (device, problem) should use. Pure; no I/O,
nothing of ours imported, so the database (`db.apply_rule`), the service and the training job's
in-job answers (`autotuner.runtime.answers`) all decide with this one function.

1. The reference program is the default: `baseline` (the hand-written gather-then-multiply),
   or on TPU `plain` (what the user's `jax.jit` compiles to; XLA:TPU windows einsums itself),
   see `reference_method`. Every ratio is the reference's time over the strategy's.
2. Another strategy beats it only if the lower end of its speedup interval is above
   `MIN_SPEEDUP_LO` (1.0) plus its session's noise floor (the A/A width, `Evidence.noise`: how far
   from 1.0 the interval of the reference against a second copy of itself reached): noise never
   wins. An estimate has no interval; its point is its lower end, so on an estimate target a
   strategy wins if it is estimated faster at all.
3. A winner is only a winner over `plain` too: where plain was measured beside a baseline
   reference, a decomposition's lower end must also clear plain's ratio, as it clears the
   reference's (1.0) (`plain` itself may win over the baseline: leave the pair to the compiler).
4. A control (`serial`: a ring decomposed but not overlapped) never wins.
5. Among those, the highest ratio wins (ties: the higher lower end, then the earlier evidence),
   unless it is weaker evidence than another that qualifies: from a weaker source
   (`MEASUREMENT_SOURCES`: a tuning run's measurement is stronger than a training job's in-job one)
   or from under half its repetitions. Weaker evidence wins only where its interval says it is
   better: its lower end above the stronger one's upper end. So a noisy 3-repetition in-job run
   never replaces a tuned winner on a point estimate (issue 38).

Where nothing wins but a strategy's interval reaches past its noise floor (its lower end does
not), the evidence does not decide: the reference stays, and `unresolved` says so and why.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["EXACT_SOURCES", "MEASUREMENT_SOURCES", "MIN_SPEEDUP_LO", "SOURCES", "Evidence", "choose", "exact_source",
           "reference_method", "source_rank", "unresolved"]

MIN_SPEEDUP_LO = 1.0
CONTROL = "serial"   # a ring's serial control (`Strategy.serial`): measured, never a winner

# Where an answer comes from: this problem's winner, measured (`tuned`) or, on a compile-only
# target (`aot:tpu:...`), estimated by the compiler (`estimated`, never `tuned`); or from elsewhere.
SOURCES = ("tuned", "estimated", "nearest", "model", "default")
EXACT_SOURCES = frozenset({"tuned", "estimated"})
# Who measured a stored measurement, strongest first: a tuning run (`autotuner tune`, a worker: its
# search, its repetitions, an A/A check) or a training job tuning what it missed (`overlap(tune=
# "missing")`: a few repetitions inside a job). A measurement stored before sources were recorded
# (None) counts as `tuned`: that is what wrote them.
MEASUREMENT_SOURCES = ("tuned", "in-job")


def source_rank(source: str | None) -> int:
    """0 for the strongest source (`MEASUREMENT_SOURCES`); None counts as `tuned`."""
    return MEASUREMENT_SOURCES.index(source) if source in MEASUREMENT_SOURCES else 0


def exact_source(estimated: bool) -> str:
    """The source of an answer from this problem's own winner on a device (`Device.estimated`)."""
    return "estimated" if estimated else "tuned"


class Evidence(NamedTuple):
    """One successful measurement (or estimate) as the rule reads it."""

    method: str
    ratio: float | None
    lo: float | None
    hi: float | None
    noise: float | None = None   # its session's A/A width (None: no twin timed, or an estimate)
    label: str = ""              # the strategy's key, for what `unresolved` says
    source: str | None = None    # who measured it (`MEASUREMENT_SOURCES`; None: tuned)
    n: int = 0                   # its repetitions (0: not known)


def reference_method(platform: str | None) -> str:
    """The method every candidate is measured against on `platform` (see the module doc)."""
    return "plain" if platform == "tpu" else "baseline"


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def choose(evidence: Sequence[Evidence], reference: str) -> int | None:
    """The index of the winning evidence, or None: the reference stays. `evidence` in the order
    it was gathered (the earlier wins a tie)."""
    floor = MIN_SPEEDUP_LO
    if reference != "plain":
        plain = [e.ratio for e in evidence if e.method == "plain" and _finite(e.ratio)]
        plain_floor = max([floor, *plain])
    else:
        plain_floor = floor
    qualified: list[int] = []
    for i, e in enumerate(evidence):
        if e.method in (reference, CONTROL) or not (_finite(e.ratio) and _finite(e.lo)):
            continue
        assert e.ratio is not None and e.lo is not None
        need = (floor if e.method in ("plain", "baseline") else plain_floor) + _noise(e)
        if e.lo > need:
            qualified.append(i)
    best_first = sorted(qualified, key=lambda i: (evidence[i].ratio, evidence[i].lo, -i), reverse=True)
    for i in best_first:   # the strongest always passes: nothing that qualified is stronger
        lo = evidence[i].lo
        assert lo is not None
        if all(lo > _top(evidence[j]) for j in qualified if weaker(evidence[i], evidence[j])):
            return i
    return None


def weaker(e: Evidence, f: Evidence) -> bool:
    """Whether `e` is weaker evidence than `f`: from a weaker source (`MEASUREMENT_SOURCES`), or
    from the same with under half `f`'s repetitions."""
    re_, rf = source_rank(e.source), source_rank(f.source)
    return re_ > rf or (re_ == rf and 2 * e.n < f.n)


def _top(e: Evidence) -> float:
    """The upper end of `e`'s interval (its point where it has none: an estimate)."""
    return e.hi if _finite(e.hi) else e.ratio  # type: ignore[return-value]


def _noise(e: Evidence) -> float:
    return e.noise if e.noise is not None and math.isfinite(e.noise) and e.noise > 0 else 0.0


def unresolved(evidence: Sequence[Evidence], reference: str) -> str | None:
    """Why the evidence does not decide, or None where it does: nothing wins (`choose`), yet a
    strategy's interval reaches past its floor (1.0 plus its session's noise) while its lower end
    does not, so that more or quieter repetitions could make it win. The reference stays meanwhile:
    a coin flip is not stored as a winner."""
    if choose(evidence, reference) is not None:
        return None
    open_ = [e for e in evidence if e.method not in (reference, CONTROL) and _finite(e.ratio) and _finite(e.lo)
             and _finite(e.hi) and e.hi > MIN_SPEEDUP_LO + _noise(e)]  # type: ignore[operator]
    if not open_:
        return None
    e = max(open_, key=lambda e: (e.ratio, e.lo))
    noise = f"the session's A/A noise +/-{100 * _noise(e):.1f}%" if _noise(e) else "no A/A noise floor"
    return (f"not resolved: {e.label or e.method} {e.ratio:.3f}x [{e.lo:.3f}, {e.hi:.3f}] may or may not beat the "
            f"{reference} (its interval's lower end does not clear 1.0 plus {noise}); the {reference} "
            "stays until more or quieter repetitions decide")

"""The winner rule, once: which measured strategy a (device, problem) should use. Pure; no I/O,
nothing of ours imported, so the database (`db.apply_rule`), the service and the training job's
in-job answers (`autotuner.runtime.answers`) all decide with this one function.

1. The reference program is the default: `baseline` (the hand-written gather-then-multiply),
   or on TPU `plain` (what the user's `jax.jit` compiles to; XLA:TPU windows einsums itself),
   see `reference_method`. Every ratio is the reference's time over the strategy's.
2. Another strategy beats it only if the lower end of its speedup interval is above
   `MIN_SPEEDUP_LO` (1.0): noise never wins. An estimate has no interval; its point is its lower
   end, so on an estimate target a strategy wins if it is estimated faster at all.
3. A winner is only a winner over `plain` too: where plain was measured beside a baseline
   reference, a decomposition's lower end must also clear plain's ratio, as it clears the
   reference's (1.0) (`plain` itself may win over the baseline: leave the pair to the compiler).
4. A control (`serial`: a ring decomposed but not overlapped) never wins.
5. Among those, the highest ratio wins (ties: the higher lower end, then the earlier evidence).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["EXACT_SOURCES", "MIN_SPEEDUP_LO", "SOURCES", "Evidence", "choose", "exact_source", "reference_method"]

MIN_SPEEDUP_LO = 1.0
CONTROL = "serial"   # a ring's serial control (`Strategy.serial`): measured, never a winner

# Where an answer comes from: this problem's winner, measured (`tuned`) or, on a compile-only
# target (`aot:tpu:...`), estimated by the compiler (`estimated`, never `tuned`); or from elsewhere.
SOURCES = ("tuned", "estimated", "nearest", "model", "default")
EXACT_SOURCES = frozenset({"tuned", "estimated"})


def exact_source(estimated: bool) -> str:
    """The source of an answer from this problem's own winner on a device (`Device.estimated`)."""
    return "estimated" if estimated else "tuned"


class Evidence(NamedTuple):
    """One successful measurement (or estimate) as the rule reads it."""

    method: str
    ratio: float | None
    lo: float | None
    hi: float | None


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
    best: tuple[float, float, int] | None = None
    for i, e in enumerate(evidence):
        if e.method in (reference, CONTROL) or not (_finite(e.ratio) and _finite(e.lo)):
            continue
        assert e.ratio is not None and e.lo is not None
        need = floor if e.method in ("plain", "baseline") else plain_floor
        if e.lo > need and (best is None or (e.ratio, e.lo, -i) > best):
            best = (e.ratio, e.lo, -i)
    return None if best is None else -best[2]

"""The valid strategies for a problem on a device: invalid combinations are left out, never built."""

from __future__ import annotations

import itertools

from .device import Device
from .problem import Problem
from .strategy import CHUNKS, DIRECTIONS, FUSES, UNROLLS, Strategy, StrategyError


def space(problem: Problem, device: Device | None = None) -> list[Strategy]:
    """Every valid Strategy for `problem`, baseline first, in a stable order.

    `device` is accepted for platform-specific candidates (none on CPU yet); the ring
    decompositions are valid on every platform.
    """
    from .strategies import check_valid

    out = [Strategy.baseline()]
    if problem.pattern.kind == "none" or problem.axis_size == 1:
        return out  # nothing to communicate: a ring of one device is the baseline again
    fuses = FUSES if problem.pattern.kind == "all_gather" else ("loop",)
    for d, c, u, f, sf in itertools.product(DIRECTIONS, CHUNKS, UNROLLS, fuses, (True, False)):
        s = Strategy("ring", d, c, u, f, sf)
        try:
            check_valid(problem, s)
        except StrategyError:
            continue
        out.append(s)
    return out

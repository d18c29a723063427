"""Memory: what a decomposition holds, and the bound the pass keeps the compiled step within.

A ring that keeps its gathered value for the gather's other users (a forward input its weight
gradient reuses) holds that value from the ring to its last user, often from the forward to the
backward pass; the rings' own buffers add a little more. The pass compares the temp (scratch) bytes
per device of the compiled programs, plain (from the analysis compile) and overlapped, and by
default sheds decompositions until the growth is at most `DEFAULT_BOUND`: kept gathers first
(largest first; a forced ring then runs without keeping, an `auto` one stays baseline), then rings
(least predicted saving first, in doubling batches), recompiling after each step.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from autotuner.problem import GroupedProblem, Problem

DEFAULT_BOUND = 0.05   # temp memory may grow by at most this fraction of plain jit's


def check_bound(memory: Any) -> float | None:
    """`overlap(..., memory=)`: a fraction >= 0 (0.05: +5%), or None for no bound."""
    if memory is None:
        return None
    if isinstance(memory, bool) or not isinstance(memory, (int, float)) or not math.isfinite(memory) or memory < 0:
        raise ValueError(f"memory must be a growth fraction >= 0 (0.05 for +5%) or None, got {memory!r}")
    return float(memory)


def gathered_bytes(problem: Problem | GroupedProblem) -> int:
    """Bytes per device of an all-gather problem's gathered operand (what a kept gather holds);
    0 for a reduce-scatter."""
    p = problem.members[0] if isinstance(problem, GroupedProblem) else problem
    pat = p.pattern
    if pat.kind != "all_gather":
        return 0
    op = p.lhs if pat.operand == "lhs" else p.rhs
    mesh = dict(p.mesh)
    n = math.prod(op.shape)
    for entry in op.spec:
        for axis in entry:
            if axis != pat.axis:
                n //= mesh[axis]
    return n * np.dtype(p.dtype).itemsize


def growth(plain: int | None, overlapped: int | None) -> float | None:
    """Relative growth of temp bytes, overlapped vs plain (None where either is unknown)."""
    if plain is None or overlapped is None:
        return None
    return overlapped / plain - 1.0 if plain else (0.0 if overlapped == 0 else math.inf)


def over(plain: int | None, overlapped: int | None, bound: float | None) -> bool:
    g = growth(plain, overlapped)
    return bound is not None and g is not None and g > bound + 1e-12


def mib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**20:.2f} MiB"


def shed(actions: dict[str, Any], rows: list[Any], tags: list[str | None], excess: int, bound: float,
         rings_shed: int) -> dict[str, str]:
    """One step of fitting the bound: take decompositions out of `actions` (a dict tag -> Action,
    changed in place) and return {tag: why} for the rows they concern. Kept gathers go first,
    largest first, until their bytes cover `excess` (a forced ring then runs without keeping, an
    `auto` one, whose keep is what pays, is left out); with none left, rings, least predicted
    saving first, twice as many as the last ring step (`rings_shed`: how many it took)."""
    from dataclasses import replace

    units: dict[tuple[str, ...], Any] = {}
    for tag, act in actions.items():
        units.setdefault(act.tags or (tag,), act)
    limit = f"+{100 * bound:g}%"
    why: dict[str, str] = {}
    keeps = sorted(((u, a) for u, a in units.items() if a.keep), key=lambda ua: -gathered_bytes(ua[1].problem))
    if keeps:
        covered = 0
        for unit, act in keeps:
            held = gathered_bytes(act.problem)
            if act.strict:
                text = (f"the memory bound: keeping its gathered value ({mib(held)} per device) would grow "
                        f"temp memory past {limit} of plain jit's, and its all-gather would stay: baseline")
                for t in unit:
                    actions.pop(t, None)
            else:
                text = (f"the memory bound: its gathered value ({mib(held)} per device) is not kept "
                        f"(temp memory past {limit} of plain jit's); its other users gather it again")
                for t in unit:
                    if t in actions:
                        actions[t] = replace(actions[t], keep=False)
            why.update(dict.fromkeys(unit, text))
            covered += held
            if covered >= excess:
                break
        return why
    speed = {r_tag: (r.speedup or 0.0) for r_tag, r in zip(tags, rows, strict=True) if r_tag}
    order = sorted(units, key=lambda u: min(speed.get(t, 0.0) for t in u))
    text = f"the memory bound: temp memory past {limit} of plain jit's with this ring: baseline"
    for unit in order[:max(1, 2 * rings_shed)]:
        for t in unit:
            actions.pop(t, None)
        why.update(dict.fromkeys(unit, text))
    return why

"""Memory: what a decomposition may add, and the bound the pass keeps the compiled step within.

A ring that keeps its gathered value for the gather's other users (a forward input its weight
gradient reuses) holds that value from the ring to its last user, often from the forward to the
backward pass; a ring's chunks, partial results and carries, and the schedule around them, add
more: on penzai's GPT-NeoX step (`bench/pass_cost.py --model penzai-neox --memory none`: +19.9% at 2
layers) the attention rings grow the step most, by about their results' size, more than plain
jit's all-gather held (its gathered operand).

The bound (`DEFAULT_BOUND` of plain jit's temp bytes, from the analysis compile) is kept in at
most one more compile than the unbounded plan:
1. `fit`, before the compile: each ring is charged its largest array less what plain jit's
   collective materializes there (`ring_bytes`), and rings are shed, least predicted saving per
   byte first, until the charges fit. Kept gathers are not charged: plain jit may hold the same
   value for its weight gradient (at the README's bench size, keeping them shrinks the step).
   Where one ring is charged more than the plain step's whole temp memory, no charge is believed
   (that array is one of the step's inputs, a parameter on a toy-sized step, which temp memory
   does not hold). A ring in a loop's body (a scanned layer's) is not charged either: its arrays
   live for one iteration, and whether that is at the step's peak, which a scanned step's stacked
   residuals set, only the compiled step says (Flax's scanned GPT, `bench/pass_cost.py --model
   flax-scan`: all twelve rings +4.0% at 2 layers, inside the bound, where charging them shed most).
2. The compiled step is checked. Past the bound, `cover` sheds once more, kept gathers first
   (largest first; a forced ring then runs without keeping, an `auto` one, whose keep is what
   pays, stays baseline), then rings, each taken to account for the measured growth in
   proportion to its gross charge, for `MARGIN` times the excess, and the step is compiled once
   more.
3. Past the bound still, the whole step runs as plain jit, and every row says why.
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


def _device_bytes(shape: tuple[int, ...], spec: tuple[tuple[str, ...], ...], mesh: dict[str, int],
                  itemsize: int) -> int:
    """Bytes per device of an array of `shape` laid out as `spec` on `mesh`."""
    n = math.prod(shape)
    for entry in spec:
        for axis in entry:
            n //= mesh[axis]
    return n * itemsize


def gathered_bytes(problem: Problem | GroupedProblem) -> int:
    """Bytes per device of an all-gather problem's gathered operand (what a kept gather holds);
    0 for a reduce-scatter."""
    p = problem.members[0] if isinstance(problem, GroupedProblem) else problem
    pat = p.pattern
    if pat.kind != "all_gather":
        return 0
    op = p.lhs if pat.operand == "lhs" else p.rhs
    spec = tuple(tuple(a for a in entry if a != pat.axis) for entry in op.spec)
    return _device_bytes(op.shape, spec, dict(p.mesh), np.dtype(p.dtype).itemsize)


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


def ring_bytes(problem: Problem | GroupedProblem, net: bool = True) -> int:
    """What one decomposition's ring may add to the step's temp bytes per device, summed over a
    group's einsums, less, with `net`, what plain jit's collective materializes there and a ring
    never does (`_plain_holds`). An all-gather's ring: its largest array (either operand as it
    arrives, or the result). A reduce-scatter's ring moves partial results only, its operands stay
    where they are: two blocks of the scattered result (the sum so far and the one in flight).
    (Charging a reduce-scatter's largest array, a weight it never copies, shed rings whose compiled
    step had less temp memory than plain jit's: keras-hub's Llama step, -10.7% with them all.)"""
    members = problem.members if isinstance(problem, GroupedProblem) else (problem,)
    total = 0
    for p in members:
        mesh, size = dict(p.mesh), np.dtype(p.dtype).itemsize
        if p.pattern.kind == "reduce_scatter":
            largest = 2 * _device_bytes(p.out_shape, p.out_spec, mesh, size)
        else:
            arrays = ((p.lhs.shape, p.lhs.spec), (p.rhs.shape, p.rhs.spec), (p.out_shape, p.out_spec))
            largest = max(_device_bytes(shape, spec, mesh, size) for shape, spec in arrays)
        total += max(0, largest - _plain_holds(p)) if net else largest
    return total


def _plain_holds(p: Problem) -> int:
    """Bytes per device plain jit's collective materializes for the einsum, which a ring never
    does: an all-gather's gathered operand, a reduce-scatter's unscattered partial result."""
    if p.pattern.kind == "all_gather":
        return gathered_bytes(p)
    if p.pattern.kind != "reduce_scatter":
        return 0
    return _device_bytes(p.out_shape, p.out_spec, dict(p.mesh), np.dtype(p.dtype).itemsize) * p.axis_size


def charge(act: Any, net: bool = True) -> int:
    """A decomposition's charge: its ring, and the gathered value it keeps."""
    return ring_bytes(act.problem, net) + (gathered_bytes(act.problem) if act.keep else 0)


def _units(actions: dict[str, Any]) -> dict[tuple[str, ...], Any]:
    units: dict[tuple[str, ...], Any] = {}
    for tag, act in actions.items():
        units.setdefault(act.tags or (tag,), act)
    return units


def _rings(units: dict[tuple[str, ...], Any], speedups: dict[str, float | None]) -> list[tuple[str, ...]]:
    """The rings in the order they are shed: least predicted saving per (gross) byte first."""
    def value(u: tuple[str, ...]) -> tuple[float, int]:
        gain = max(0.0, min((speedups.get(t) or 1.0) for t in u) - 1.0)
        gross = ring_bytes(units[u].problem, net=False)
        return gain / max(1, gross), -gross

    return sorted(units, key=value)


def _steps(units: dict[tuple[str, ...], Any], speedups: dict[str, float | None]) -> list[tuple[tuple[str, ...], bool]]:
    """The order `cover` sheds in, (unit, its keep only?): kept gathers first, largest first, then
    the rings (`_rings`)."""
    keeps = sorted((u for u, a in units.items() if a.keep), key=lambda u: -gathered_bytes(units[u].problem))
    return [(u, True) for u in keeps] + [(u, False) for u in _rings(units, speedups)]


def _shed(actions: dict[str, Any], units: dict[tuple[str, ...], Any], unit: tuple[str, ...], keep_only: bool,
          limit: str) -> str:
    """Take one step of `_steps` out of `actions` (and `units`); why, for its rows."""
    from dataclasses import replace

    act = units[unit]
    if keep_only and not act.strict:
        units[unit] = replace(act, keep=False)
        for t in unit:
            if t in actions:
                actions[t] = replace(actions[t], keep=False)
        return (f"the memory bound: its gathered value ({mib(gathered_bytes(act.problem))} per device) is not "
                f"kept (temp memory past {limit} of plain jit's); its other users gather it again")
    del units[unit]
    for t in unit:
        actions.pop(t, None)
    if keep_only:
        return (f"the memory bound: keeping its gathered value ({mib(gathered_bytes(act.problem))} per device) "
                f"could grow temp memory past {limit} of plain jit's, and its all-gather would stay: baseline")
    return (f"the memory bound: this ring may add up to {mib(ring_bytes(act.problem, net=False))} per device, "
            f"and with it temp memory could grow past {limit} of plain jit's: baseline")


def fit(actions: dict[str, Any], speedups: dict[str, float | None], budget: int, bound: float,
        looped: frozenset[str] = frozenset()) -> dict[str, str]:
    """Before the compile: shed rings from `actions` (tag -> Action, changed in place), least
    predicted saving per byte first, until their net charges (`ring_bytes`) add up to at most
    `budget` bytes (`bound` times plain jit's temp bytes); {tag: why} for each tag shed. Kept
    gathers are not charged here: whether plain jit holds the same value (its weight gradient's
    operand) depends on its schedule, so only the compiled step says (`cover`); nor are the
    rings of the dots in a loop's body (`looped`: their tags)."""
    units = {u: a for u, a in _units(actions).items() if not looped.intersection(u)}
    why: dict[str, str] = {}
    charges = {u: ring_bytes(a.problem) for u, a in units.items()}
    if any(c > budget / bound for c in charges.values()):
        # a ring charged more than the plain step's whole temp memory: its largest array is then
        # one of the step's inputs (a parameter, on a toy-sized step), which temp memory does not
        # hold; such charges say nothing, and the compiled step decides (`cover`)
        return why
    total = sum(charges.values())
    for unit in _rings(units, speedups):
        if total <= budget:
            break
        total -= charges[unit]
        why.update(dict.fromkeys(unit, _shed(actions, units, unit, False, f"+{100 * bound:g}%")))
    return why


MARGIN = 1.5   # `cover` sheds for this many times the excess: one recompile is all it gets


def cover(actions: dict[str, Any], speedups: dict[str, float | None], excess: int, grown: int,
          bound: float) -> dict[str, str]:
    """After a compile past the bound (the prediction missed): the step grew by `grown` bytes,
    `excess` of them past the bound. Each decomposition left is taken to account for that growth
    in proportion to its gross charge (its ring's largest array, plus what it keeps); they are
    shed in `_steps`' order until what they account for covers `MARGIN` times the excess.
    {tag: why}."""
    units, why = _units(actions), {}
    gross = {u: charge(a, net=False) for u, a in units.items()}
    scale = grown / max(1, sum(gross.values()))
    freed = 0.0
    for unit, keep_only in _steps(units, speedups):
        if freed >= MARGIN * excess or not units:
            break
        if unit in units and (units[unit].keep or not keep_only):
            act = units[unit]
            part = gathered_bytes(act.problem) if keep_only and not act.strict else gross[unit]
            freed += scale * part
            why.update(dict.fromkeys(unit, _shed(actions, units, unit, keep_only, f"+{100 * bound:g}%")))
    return why

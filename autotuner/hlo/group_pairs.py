"""Grouping the pairs of one all-gather: a gather whose result feeds k >= 2 mapped dots is one
`GroupedProblem` (the program gathers once and multiplies k times), not k single problems.

Before grouping, each dot fed by a shared gather became its own pair and its own Problem (Q, K and
V of sequence-parallel attention counted three all-gathers where the program runs one). Here the
mapped pairs are grouped by their collective instruction: pairs of one all-gather are the members
of a group, in the module's order; a gather with one mapped dot stays a single Problem. A gather
whose other users are not decomposable dots (a weight gradient whose output needs an all-reduce,
say) still groups the dots that are: those users are the extraction's skipped pairs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from autotuner.hlo.pairs import Pair
from autotuner.problem import GroupedProblem, Problem, ProblemError

log = logging.getLogger(__name__)


def group_units(mapped: Sequence[tuple[Pair, Problem, int]]
                ) -> list[tuple[Problem | GroupedProblem, list[Pair], int]]:
    """One unit per all-gather with k >= 2 mapped dots (a GroupedProblem with those dots' pairs,
    in the module's order, the members' order) and per other mapped pair (its Problem): the unit,
    its pairs, how many times it runs per call. In the order of the units' first pairs. For a
    pass that rewrites the program, `pairs[m]` is the dot of `members[m]`."""
    by_gather: dict[str, list[tuple[Pair, Problem, int]]] = {}
    for item in mapped:
        if item[0].kind == "all_gather":
            by_gather.setdefault(item[0].collective.name, []).append(item)
    out: list[tuple[Problem | GroupedProblem, list[Pair], int]] = []
    done: set[str] = set()
    for pair, problem, times in mapped:
        members = by_gather.get(pair.collective.name, []) if pair.kind == "all_gather" else []
        if len(members) < 2:
            out.append((problem, [pair], times))
            continue
        if pair.collective.name in done:
            continue
        done.add(pair.collective.name)
        try:
            unit = GroupedProblem(tuple(p for _, p, _ in members))
        except ProblemError as e:   # not one operand gathered alike: keep them single
            log.debug("extract: all-gather %s feeds %d dots that do not form a group (%s)",
                      pair.collective.name, len(members), e)
            out.extend((p, [q], t) for q, p, t in members)
            continue
        log.debug("extract: all-gather %s feeds %d dots: %s", pair.collective.name, len(members), unit.describe())
        out.append((unit, [q for q, _, _ in members], times))
    return out


def group_problems(mapped: Sequence[tuple[Pair, Problem, int]]
                   ) -> list[tuple[Problem | GroupedProblem, int]]:
    """[(Problem or GroupedProblem, count)] from the mapped pairs (pair, its Problem, how many times
    the pair runs per call), in order of first occurrence; the same key twice adds its counts."""
    found: dict[str, list[object]] = {}
    for unit, _, times in group_units(mapped):
        _add(found, unit, times)
    return [(p, c) for p, c in found.values()]  # type: ignore[misc]


def _add(found: dict[str, list[object]], unit: Problem | GroupedProblem, times: int) -> None:
    slot = found.setdefault(unit.key, [unit, 0])
    slot[1] = int(slot[1]) + times  # type: ignore[call-overload]

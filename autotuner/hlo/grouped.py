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


def group_problems(mapped: Sequence[tuple[Pair, Problem, int]]
                   ) -> list[tuple[Problem | GroupedProblem, int]]:
    """[(Problem or GroupedProblem, count)] from the mapped pairs (pair, its Problem, how many times
    the pair runs per call), in order of first occurrence; the same key twice adds its counts."""
    by_gather: dict[str, list[tuple[Pair, Problem, int]]] = {}
    for item in mapped:
        pair = item[0]
        if pair.kind == "all_gather":
            by_gather.setdefault(pair.collective.name, []).append(item)
    found: dict[str, list[object]] = {}
    done: set[str] = set()
    for pair, problem, times in mapped:
        unit: Problem | GroupedProblem = problem
        if pair.kind == "all_gather":
            name = pair.collective.name
            if name in done:
                continue
            members = by_gather[name]
            if len(members) >= 2:
                done.add(name)
                try:
                    unit = GroupedProblem(tuple(p for _, p, _ in members))
                except ProblemError as e:   # not one operand gathered alike: keep them single
                    log.debug("extract: all-gather %s feeds %d dots that do not form a group (%s)",
                              name, len(members), e)
                    for _, p, t in members:
                        _add(found, p, t)
                    continue
                log.debug("extract: all-gather %s feeds %d dots: %s", name, len(members), unit.describe())
        _add(found, unit, times)
    return [(p, c) for p, c in found.values()]  # type: ignore[misc]


def _add(found: dict[str, list[object]], unit: Problem | GroupedProblem, times: int) -> None:
    slot = found.setdefault(unit.key, [unit, 0])
    slot[1] = int(slot[1]) + times  # type: ignore[call-overload]

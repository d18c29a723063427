"""Every pair of a partitioned module with its Problem or the reason it has none (for the
overlap pass, which needs each pair, not the Problems grouped by key as `extract_from_hlo` gives)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from autotuner.hlo.evaluate import manual_computations, multiplicity
from autotuner.hlo.pairs import Pair, find_pairs
from autotuner.hlo.problems import match_dot
from autotuner.hlo.shardings import MeshInfo
from autotuner.hlo.text import PASS_THROUGH, ExtractError, HloModule, parse_hlo
from autotuner.problem import Problem

__all__ = ["MappedPair", "map_pairs", "other_users"]


@dataclass
class MappedPair:
    """One pair of the partitioned module and what it maps to: a Problem, or why not."""

    pair: Pair
    problem: Problem | None
    reason: str | None       # why no Problem (None when mapped)
    times: int               # runs per program call (loop trips around it)
    other_users: int = 0     # all-gather: other instructions its gathered value reaches (a shared gather)


def map_pairs(propagated: str, partitioned: str, mesh: Mapping[str, int] | MeshInfo,
              skipped: list[tuple[str, str]] | None = None) -> tuple[list[MappedPair], int]:
    """Every pair of the partitioned module, in program order, each with its Problem or the reason
    it has none; and the number of partitions. `skipped` collects (where, why) of the collective/dot
    pairs that could not even be read as a pair. Matches dots as `extract_from_hlo` does."""
    info = mesh if isinstance(mesh, MeshInfo) else MeshInfo(tuple(mesh), tuple(mesh.values()))
    post, pre = parse_hlo(partitioned), parse_hlo(propagated)
    if post.num_partitions != info.size:
        raise ExtractError(f"the module runs on {post.num_partitions} partitions but the mesh "
                           f"{info.as_dict()} has {info.size} devices")
    pairs = find_pairs(post, info, [] if skipped is None else skipped)
    times = multiplicity(post)
    manual = manual_computations(post)
    pre_dots = [pre.instrs[n] for n in pre.order if pre.instrs[n].opcode == "dot"]
    used: set[str] = set()
    out: list[MappedPair] = []
    for pair in pairs:
        n = times.get(pair.dot.computation, 1)
        if pair.dot.computation in manual:
            out.append(MappedPair(pair, None, "inside shard_map (already manually partitioned)", n))
            continue
        got = match_dot(pair, post, pre, pre_dots, used, info)
        result, why = (None, got) if isinstance(got, str) else (got, None)
        out.append(MappedPair(pair, result, why, n, other_users(post, pair)))
    return out, post.num_partitions


def other_users(mod: HloModule, pair: Pair) -> int:
    """How many instructions besides the pair's dot use the all-gather's value (through layout ops)."""
    if pair.kind != "all_gather":
        return 0
    seen: set[str] = set()
    todo, ends = [pair.collective.name], set()
    while todo:
        for u in mod.users.get(todo.pop(), []):
            if u in seen:
                continue
            seen.add(u)
            if mod.instrs[u].opcode in PASS_THROUGH:
                todo.append(u)
            elif u != pair.dot.name:
                ends.add(u)
    return len(ends)

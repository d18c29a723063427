"""The pairs: an all-gather feeding a dot, a dot feeding a reduce-scatter (or XLA:CPU's
all-reduce + dynamic-slice), found in the partitioned module through layout-only ops."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from autotuner.hlo.evaluate import per_partition
from autotuner.hlo.shardings import MeshInfo, parse_replica_groups
from autotuner.hlo.text import PASS_THROUGH, HloModule, Instr
from autotuner.problem import Problem

log = logging.getLogger(__name__)

# -- dim tracking through layout ops ------------------------------------------------------------------

def _reshape_map(src: Sequence[int], dst: Sequence[int], d: int) -> int | None:
    """Dim `d` of `src` as a dim of `dst` when a reshape keeps it whole, else None."""
    pre = math.prod(src[:d])
    for e in range(len(dst)):
        if math.prod(dst[:e]) == pre and dst[e] == src[d]:
            return e
    return None


def _forward(ins: Instr, in_shape: Sequence[int], d: int) -> int | None:
    """Where dim `d` of the operand lands in `ins`'s result."""
    if ins.shape is None:
        return None
    if ins.opcode in ("copy", "convert"):
        return d
    if ins.opcode == "transpose":
        perm = list(ins.attr_ints("dimensions"))
        return perm.index(d) if d in perm else None
    if ins.opcode in ("reshape", "bitcast"):
        return d if tuple(in_shape) == ins.shape else _reshape_map(in_shape, ins.shape, d)
    return None


def _backward(ins: Instr, in_shape: Sequence[int], d: int) -> int | None:
    """Which operand dim becomes dim `d` of `ins`'s result."""
    if ins.shape is None:
        return None
    if ins.opcode in ("copy", "convert"):
        return d
    if ins.opcode == "transpose":
        perm = ins.attr_ints("dimensions")
        return perm[d] if d < len(perm) else None
    if ins.opcode in ("reshape", "bitcast"):
        return d if tuple(in_shape) == ins.shape else _reshape_map(ins.shape, in_shape, d)
    return None


# -- the pairs ---------------------------------------------------------------------------------------

@dataclass
class Pair:
    """One collective/dot pair in the partitioned module."""

    kind: str                      # all_gather | reduce_scatter
    dot: Instr
    collective: Instr
    operand: str | None            # all_gather: lhs | rhs
    dim: int                       # all_gather: dim of the dot operand; reduce_scatter: dim of the dot output
    axes: tuple[str, ...]          # mesh axes of the collective, major to minor
    form: str                      # all-gather | reduce-scatter | all-reduce+dynamic-slice

    def where(self) -> str:
        return f"{self.form} {self.collective.name} / dot {self.dot.name} ({self.dot.op_name or 'no op_name'})"


@dataclass
class ExtractReport:
    problems: list[tuple[Problem, int]]
    skipped: list[tuple[str, str]]   # (where, why)
    pairs: int                       # pairs seen in the partitioned HLO
    num_partitions: int
    mesh: dict[str, int]
    names: list[str] = field(default_factory=list)   # one readable name per problem (hlo/names.py)


def skip(skipped: list[tuple[str, str]], where: str, why: str) -> None:
    log.debug("extract: skipped %s: %s", where, why)
    skipped.append((where, why))


def _gather_into(mod: HloModule, dot: Instr, idx: int, mesh: MeshInfo,
                 skipped: list[tuple[str, str]]) -> Pair | None:
    chain: list[Instr] = []
    cur = mod.op(dot.operands[idx])
    while cur is not None and cur.opcode in PASS_THROUGH and cur.operands:
        chain.append(cur)
        cur = mod.op(cur.operands[0])
    if cur is None or cur.opcode != "all-gather":
        return None
    where = f"all-gather {cur.name} / dot {dot.name} ({dot.op_name or 'no op_name'})"
    if len(cur.operands) != 1 or cur.shape is None:
        skip(skipped, where, "a combined (tuple) all-gather")
        return None
    dims = cur.attr_ints("dimensions")
    src = mod.op(cur.operands[0])
    if len(dims) != 1 or src is None or src.shape is None:
        skip(skipped, where, "cannot read the gathered dimension")
        return None
    d = dims[0]
    shape: Sequence[int] = cur.shape
    for ins in reversed(chain):
        nd = _forward(ins, shape, d)
        if nd is None:
            skip(skipped, where, f"the gathered dimension does not survive {ins.opcode} {ins.name}")
            return None
        d, shape = nd, ins.shape or ()
    groups = parse_replica_groups(cur, mod.num_partitions)
    axes = mesh.group_axes(groups) if groups is not None else None
    if axes is None:
        skip(skipped, where, f"replica groups {cur.attrs.get('replica_groups')!r} are not whole mesh axes")
        return None
    if cur.shape[dims[0]] != src.shape[dims[0]] * math.prod(mesh.as_dict()[a] for a in axes):
        skip(skipped, where, "the gathered size does not match the group size")
        return None
    return Pair("all_gather", dot, cur, "lhs" if idx == 0 else "rhs", d, axes, "all-gather")


def _is_add(mod: HloModule, ins: Instr) -> bool:
    comp = ins.attrs.get("to_apply", "").lstrip("%")
    names = mod.computations.get(comp, [])
    if not names:
        return False
    ops = [mod.instrs[n].opcode for n in names if mod.instrs[n].opcode != "parameter"]
    return ops == ["add"]


def _follow(mod: HloModule, start: Instr) -> tuple[list[Instr], Instr | None]:
    """Single-user pass-through ops after `start`, and the first other user (None if several)."""
    chain: list[Instr] = []
    cur = start
    while True:
        users = mod.users.get(cur.name, [])
        if len(users) != 1:
            return chain, None
        nxt = mod.instrs[users[0]]
        if nxt.opcode in PASS_THROUGH:
            chain.append(nxt)
            cur = nxt
            continue
        return chain, nxt


def _back_through(chain: Sequence[Instr], first_shape: Sequence[int], d: int) -> int | None:
    """Map dim `d` of the last value of `chain` back to the value before the chain."""
    shapes = [tuple(first_shape)] + [ins.shape or () for ins in chain]
    for i in range(len(chain) - 1, -1, -1):
        nd = _backward(chain[i], shapes[i], d)
        if nd is None:
            return None
        d = nd
    return d


def _scatter_from(mod: HloModule, dot: Instr, mesh: MeshInfo, skipped: list[tuple[str, str]]) -> Pair | None:
    chain1, coll = _follow(mod, dot)
    if coll is None or coll.opcode not in ("all-reduce", "reduce-scatter"):
        return None
    where = f"{coll.opcode} {coll.name} / dot {dot.name} ({dot.op_name or 'no op_name'})"
    if coll.shape is None or len(coll.operands) != 1:
        skip(skipped, where, "a combined (tuple) collective")
        return None
    if not _is_add(mod, coll):
        skip(skipped, where, "the reduction is not a sum")
        return None
    groups = parse_replica_groups(coll, mod.num_partitions)
    gaxes = mesh.group_axes(groups) if groups is not None else None
    if gaxes is None:
        skip(skipped, where, f"replica groups {coll.attrs.get('replica_groups')!r} are not whole mesh axes")
        return None
    pre_shape = chain1[-1].shape if chain1 else dot.shape
    assert pre_shape is not None and dot.shape is not None
    if coll.opcode == "reduce-scatter":
        dims = coll.attr_ints("dimensions")
        if len(dims) != 1:
            skip(skipped, where, "cannot read the scatter dimension")
            return None
        d = _back_through(chain1, dot.shape, dims[0])
        if d is None:
            skip(skipped, where, "the scatter dimension does not survive the ops between dot and collective")
            return None
        return Pair("reduce_scatter", dot, coll, None, d, gaxes, "reduce-scatter")
    # all-reduce: its (only) consumer must be a dynamic-slice taking this device's block
    chain2, ds = _follow(mod, coll)
    if ds is None or ds.opcode != "dynamic-slice" or ds.shape is None:
        skip(skipped, where, "the all-reduce result is used whole (an all-reduce layout, not decomposed)")
        return None
    base = chain2[-1].shape if chain2 else coll.shape
    assert base is not None
    diff = [i for i, (a, b) in enumerate(zip(base, ds.shape, strict=True)) if a != b]
    n = math.prod(mesh.as_dict()[a] for a in gaxes)
    if len(diff) != 1 or base[diff[0]] != ds.shape[diff[0]] * n:
        skip(skipped, where, f"the dynamic-slice {ds.name} does not take one 1/{n} block of one dimension")
        return None
    e = diff[0]
    offsets = [per_partition(mod, o) for o in ds.operands[1:]]
    axes = gaxes
    if all(o is not None for o in offsets) and len(offsets) == len(base):
        if any(np.any(o != 0) for i, o in enumerate(offsets) if i != e):
            skip(skipped, where, "the dynamic-slice also moves along unsliced dimensions")
            return None
        off = offsets[e]
        assert off is not None
        block = off // ds.shape[e]
        if np.any(off % ds.shape[e]) or np.any(block < 0) or np.any(block >= n):
            skip(skipped, where, "the dynamic-slice offsets are not block boundaries")
            return None
        found = mesh.axes_for(block, n)
        if found is None or set(found) != set(gaxes):
            skip(skipped, where, "the blocks kept by each device do not follow the reduction group")
            return None
        axes = found
    else:
        log.debug("extract: %s: dynamic-slice offsets not evaluable; assuming group order", where)
    d = _back_through(chain2, coll.shape, e)
    d = _back_through(chain1, dot.shape, d) if d is not None else None
    if d is None:
        skip(skipped, where, "the scatter dimension does not survive the ops between dot and slice")
        return None
    return Pair("reduce_scatter", dot, coll, None, d, axes, "all-reduce+dynamic-slice")


def find_pairs(mod: HloModule, mesh: MeshInfo, skipped: list[tuple[str, str]]) -> list[Pair]:
    pairs: list[Pair] = []
    for name in mod.order:
        ins = mod.instrs[name]
        if ins.opcode != "dot" or len(ins.operands) != 2:
            continue
        for idx in (0, 1):
            p = _gather_into(mod, ins, idx, mesh, skipped)
            if p is not None:
                pairs.append(p)
        p = _scatter_from(mod, ins, mesh, skipped)
        if p is not None:
            pairs.append(p)
    return pairs

"""Find the sharded einsums this project decomposes in a real JAX program.

`extract(fn, *example_args)` lowers and compiles `fn` with the example arguments' shardings and
reads two snapshots of the HLO module that XLA dumps around its SPMD partitioner:

- *partitioned* (after `spmd-partitioning`): per-device shapes, the collectives the partitioner
  inserted and their replica groups, every dot still in its einsum form (later passes canonicalize
  dots to rank 2 and fuse everything, so the final `compiled.as_text()` is no use here);
- *propagated* (before `spmd-partitioning`): global shapes and the sharding of every dot and its
  operands, after sharding propagation.

In the partitioned module it finds the pairs this project decomposes: an `all-gather` feeding a
`dot` (possibly through copy/convert/bitcast/reshape/transpose), a `dot` feeding a
`reduce-scatter`, and the `all-reduce` + `dynamic-slice` form XLA:CPU emits in place of a
reduce-scatter. Each pair is mapped back to a `Problem`: the dot's dimension numbers give the
einsum equation, the matching dot of the propagated module gives global shapes and specs, the
collective's replica groups (and, for the dynamic-slice, its per-device offsets) give the mesh
axis. The Problem must classify as exactly the collective the HLO shows, or the pair is skipped.

A Problem's count is how many times its pairs run per call of the program: each occurrence in the
program, times the trip count of the loops around it when the loop is a counted one (the form
`lax.scan` and `fori_loop` lower to; other loops count once). Partition ids are positions in the
mesh's flattened device array (how JAX assigns devices to an SPMD computation). Dots inside
`shard_map` (manually partitioned) are skipped.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import logging
import math
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import AutotunerError
from .problem import Entry, Problem, ProblemError

log = logging.getLogger(__name__)

__all__ = ["ExtractError", "ExtractReport", "Pair", "extract", "extract_from_hlo", "extract_report",
           "partitioned_hlo"]

DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}
PASS_THROUGH = frozenset({"copy", "convert", "bitcast", "reshape", "transpose"})


class ExtractError(AutotunerError, RuntimeError):
    """The program could not be compiled or its partitioned HLO could not be obtained."""


# -- HLO text ------------------------------------------------------------------------------------

@dataclass
class Instr:
    name: str
    etype: str | None                # element type (f32, s32, ...); None for tuples / tokens
    shape: tuple[int, ...] | None    # None for tuples
    opcode: str
    operands: list[str]
    operand_text: str
    attrs: dict[str, str]
    computation: str

    def attr_ints(self, key: str) -> tuple[int, ...]:
        v = self.attrs.get(key)
        if v is None:
            return ()
        return tuple(int(t) for t in re.findall(r"-?\d+", v))

    @property
    def op_name(self) -> str:
        m = re.search(r'op_name="([^"]*)"', self.attrs.get("metadata", ""))
        return m.group(1) if m else ""

    @property
    def stack_frame(self) -> str:
        m = re.search(r"stack_frame_id=(\d+)", self.attrs.get("metadata", ""))
        return m.group(1) if m else ""


@dataclass
class HloModule:
    name: str
    num_partitions: int
    instrs: dict[str, Instr]
    order: list[str]
    computations: dict[str, list[str]]
    users: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for n in self.order:
            for o in self.instrs[n].operands:
                if o in self.instrs:
                    self.users.setdefault(o, []).append(n)

    def op(self, name: str) -> Instr | None:
        return self.instrs.get(name)


_CLOSE = {"(": ")", "[": "]", "{": "}"}


def _match(text: str, i: int) -> int:
    """Index just past the bracket that closes the one at text[i] (quotes respected)."""
    stack, quote = [], None
    j = i
    while j < len(text):
        c = text[j]
        if quote:
            if c == "\\":
                j += 1
            elif c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif c in _CLOSE:
            stack.append(_CLOSE[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return j + 1
        j += 1
    raise ValueError(f"unbalanced brackets in {text[i:i + 80]!r}")


def _split_top(text: str) -> list[str]:
    """Split on commas not nested in brackets or quotes."""
    out, depth, quote, cur = [], 0, None, []
    i = 0
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\" and i + 1 < len(text):
                cur.append(c)
                i += 1
                c = text[i]
            elif c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
            i += 1
            continue
        cur.append(c)
        i += 1
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_ARRAY_TYPE = re.compile(r"^([a-z][a-z0-9]*)\[([^\]]*)\](?:\{[^}]*\})?")
_HEADER = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*[({]")


def parse_hlo(text: str) -> HloModule:
    """A light parser for HLO text: instructions with shapes, operands and raw attributes."""
    name, parts = "", 1
    instrs: dict[str, Instr] = {}
    order: list[str] = []
    comps: dict[str, list[str]] = {}
    comp: str | None = None
    for raw in text.splitlines():
        line = raw.rstrip()
        if line.startswith("HloModule"):
            m = re.match(r"HloModule\s+([^\s,]+)", line)
            name = m.group(1) if m else ""
            m = re.search(r"num_partitions=(\d+)", line)
            parts = int(m.group(1)) if m else 1
            continue
        if comp is None:
            if line.endswith("{") and "->" in line and " = " not in line.split("(")[0]:
                m = _HEADER.match(line)
                comp = m.group(1) if m else f"computation{len(comps)}"
                comps[comp] = []
            continue
        if line.strip() == "}":
            comp = None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        try:
            ins = _parse_instr(m.group(1), m.group(2), comp)
        except (ValueError, IndexError):
            log.debug("extract: could not parse HLO line %r", line[:200])
            continue
        instrs[ins.name] = ins
        order.append(ins.name)
        comps[comp].append(ins.name)
    return HloModule(name, parts, instrs, order, comps)


def _parse_instr(name: str, rest: str, comp: str) -> Instr:
    rest = rest.strip()
    etype: str | None = None
    shape: tuple[int, ...] | None = None
    if rest.startswith("("):
        end = _match(rest, 0)
        rest = rest[end:].strip()
    else:
        m = _ARRAY_TYPE.match(rest)
        if m:
            etype = m.group(1)
            dims = [d.strip().lstrip("<=") for d in m.group(2).split(",") if d.strip()]
            shape = tuple(int(d) for d in dims)
            rest = rest[m.end():].strip()
        else:  # token[] or similar
            tok = rest.split(" ", 1)
            rest = tok[1] if len(tok) > 1 else ""
    m = re.match(r"([\w\-]+)\(", rest)
    if not m:
        raise ValueError("no opcode")
    opcode = m.group(1)
    start = m.end() - 1
    end = _match(rest, start)
    operand_text = rest[start + 1:end - 1]
    operands = re.findall(r"%([\w.\-]+)", operand_text)
    if not operands and opcode not in ("constant", "parameter", "iota", "partition-id", "replica-id"):
        operands = [t.split()[-1] for t in _split_top(operand_text) if t.split()]
    attrs: dict[str, str] = {}
    tail = rest[end:].strip()
    if tail.startswith(","):
        tail = tail[1:]
    last = None
    for item in _split_top(tail):
        if "=" in item:
            k, v = item.split("=", 1)
            k = k.strip()
            attrs[k] = v.strip()
            last = k
        elif last is not None:
            attrs[last] += ", " + item
    return Instr(name, etype, shape, opcode, operands, operand_text, attrs, comp)


# -- device groups and shardings -------------------------------------------------------------------

@dataclass(frozen=True)
class MeshInfo:
    """The logical mesh: axis names and sizes; partition p sits at np.unravel_index(p, sizes)."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.sizes)

    def coords(self) -> np.ndarray:
        """[size, naxes] mesh coordinates of each partition id."""
        return np.stack(np.unravel_index(np.arange(self.size), self.sizes), axis=-1) if self.names else \
            np.zeros((1, 0), dtype=int)

    def as_dict(self) -> dict[str, int]:
        return dict(zip(self.names, self.sizes, strict=True))

    def axes_for(self, index: np.ndarray, count: int) -> tuple[str, ...] | None:
        """The ordered mesh axes E (major to minor) with index[p] == ravel(coords(p)[E]) for every
        partition p, where prod(sizes of E) == count; None if no such axes exist."""
        coords = self.coords()
        if count == 1:
            return () if np.all(index == 0) else None
        cand = [i for i, s in enumerate(self.sizes) if s > 1]
        for r in range(1, len(cand) + 1):
            for perm in itertools.permutations(cand, r):
                if math.prod(self.sizes[i] for i in perm) != count:
                    continue
                flat = np.ravel_multi_index(tuple(coords[:, i] for i in perm),
                                            tuple(self.sizes[i] for i in perm))
                if np.array_equal(flat, index):
                    return tuple(self.names[i] for i in perm)
        return None

    def group_axes(self, groups: np.ndarray) -> tuple[str, ...] | None:
        """The ordered axes a collective's groups [ngroups, group_size] run along (None if the
        groups are not slices of the mesh along whole axes, in mesh order)."""
        if groups.size != self.size or sorted(groups.ravel().tolist()) != list(range(self.size)):
            return None
        index = np.empty(self.size, dtype=int)
        for g in groups:
            index[g] = np.arange(len(g))
        axes = self.axes_for(index, groups.shape[1])
        if axes is None:
            return None
        others = [i for i, n in enumerate(self.names) if n not in axes]
        coords = self.coords()
        for g in groups:  # each group must be one slice: fixed coordinates on the other axes
            if others and np.any(coords[g][:, others] != coords[g[0]][others]):
                return None
        return axes


def _ints(text: str) -> list[int]:
    return [int(t) for t in re.findall(r"-?\d+", text)]


def _iota(dims: Sequence[int], reshape: Sequence[int], perm: Sequence[int] | None) -> np.ndarray:
    a = np.arange(math.prod(reshape)).reshape(tuple(reshape))
    if perm:
        a = a.transpose(tuple(perm))
    return a.reshape(tuple(dims))


def _tile_array(spec: str) -> np.ndarray:
    """`[d0,d1]<=[r0,r1]T(1,0)` or `[d0,d1]0,1,2,3` -> the device array of shape [d0, d1]."""
    m = re.match(r"\s*\[([\d,\s]*)\]\s*(.*)$", spec, re.S)
    if not m:
        raise ValueError(f"tile assignment {spec!r}")
    dims = _ints(m.group(1))
    rest = m.group(2).strip()
    if rest.startswith("<="):
        m2 = re.match(r"<=\s*\[([\d,\s]*)\]\s*(?:T\(([\d,\s]*)\))?", rest)
        if not m2:
            raise ValueError(f"iota tile assignment {spec!r}")
        return _iota(dims, _ints(m2.group(1)), _ints(m2.group(2)) if m2.group(2) else None)
    ids = _ints(rest.split(" ")[0] if rest else "")
    if len(ids) != math.prod(dims):
        raise ValueError(f"tile assignment {spec!r} lists {len(ids)} devices")
    return np.array(ids).reshape(dims)


def parse_replica_groups(ins: Instr, num_partitions: int) -> np.ndarray | None:
    """[ngroups, group_size] partition ids of a collective; None if not over partitions."""
    rg = ins.attrs.get("replica_groups")
    if "channel_id" not in ins.attrs:
        return None  # cross-replica only: not a partitioner collective
    if rg is None or rg.strip() in ("{}", "{{}}"):
        return np.arange(num_partitions).reshape(1, -1)
    rg = rg.strip()
    try:
        if rg.startswith("mesh"):
            return _mesh_groups(rg, ins.attrs.get("device_ids", ""))
        if rg.startswith("["):
            m = re.match(r"\[([\d,\s]*)\]\s*(.*)$", rg)
            assert m
            dims = _ints(m.group(1))
            return _tile_array(rg).reshape(dims[0], -1)
        groups = [_ints(g) for g in re.findall(r"\{([^{}]*)\}", rg)]
        if not groups or len({len(g) for g in groups}) != 1:
            return None
        return np.array(groups)
    except (ValueError, AssertionError, IndexError):
        log.debug("extract: could not read replica groups %r", rg)
        return None


def _mesh_groups(rg: str, device_ids: str) -> np.ndarray:
    """`mesh['a'=4,'b'=2] {'a'}` (and `device_ids=([2,4]T(1,0)) {'a'}`; sub-axes `'a':(1)2`)."""
    m = re.match(r"mesh\[(.*?)\]\s*(.*)$", rg, re.S)
    if not m:
        raise ValueError(rg)
    axes = [(n, int(s)) for n, s in re.findall(r"'?([\w.\-]+)'?\s*=\s*(\d+)", m.group(1))]
    names = [a for a, _ in axes]
    sizes = [s for _, s in axes]
    text = m.group(2) + " " + device_ids
    group_part = text[text.rfind("{"):] if "{" in text else "{}"
    ids_part = text[: text.rfind("{")] if "{" in text else text
    m_ids = re.search(r"\((.*)\)", ids_part, re.S)
    if m_ids and m_ids.group(1).strip():
        inner = m_ids.group(1).strip()
        if inner.startswith("["):
            m2 = re.match(r"\[([\d,\s]*)\]\s*(?:T\(([\d,\s]*)\))?", inner)
            assert m2
            reshape = _ints(m2.group(1))
            devices = _iota(sizes, reshape, _ints(m2.group(2)) if m2.group(2) else None)
        else:
            devices = np.array(_ints(inner)).reshape(sizes)
    else:
        devices = np.arange(math.prod(sizes)).reshape(sizes)
    refs = re.findall(r"'?([\w.\-]+)'?(?::\((\d+)\)(\d+))?", group_part.strip("{} "))
    # expand sub-axes: axis of size n split into [pre, size, n / (pre * size)]
    exp_sizes: list[int] = []
    index_of: dict[tuple[str, int | None], int] = {}
    subs = {n: (int(p), int(s)) for n, p, s in refs if p}
    for n, s in zip(names, sizes, strict=True):
        if n in subs:
            pre, size = subs[n]
            if s % (pre * size):
                raise ValueError(rg)
            index_of[(n, 1)] = len(exp_sizes) + 1
            exp_sizes += [pre, size, s // (pre * size)]
        else:
            index_of[(n, None)] = len(exp_sizes)
            exp_sizes.append(s)
    grouped = [index_of[(n, 1 if p else None)] for n, p, _s in refs if n]
    devices = devices.reshape(exp_sizes)
    rest = [i for i in range(len(exp_sizes)) if i not in grouped]
    gsize = math.prod(exp_sizes[i] for i in grouped) if grouped else 1
    return devices.transpose(rest + grouped).reshape(-1, gsize)


@dataclass(frozen=True)
class Tiling:
    tiles: np.ndarray        # device ids, shape [t_0 .. t_{r-1}, (replication dims)]
    rank: int
    manual: bool = False


def parse_sharding(text: str | None, rank: int, num_partitions: int) -> Tiling | None:
    """An HloSharding attribute as a Tiling (replicated = all tiles 1); None if unreadable."""
    if text is None:
        return None
    t = text.strip()
    if t.startswith("{"):
        t = t[1:-1].strip() if t.endswith("}") else t[1:]
    t = re.sub(r"\s*metadata=\{.*\}\s*$", "", t, flags=re.S)
    if t.startswith("{"):
        return None  # tuple sharding
    if t.startswith("replicated") or t == "":
        return Tiling(np.arange(num_partitions).reshape([1] * rank + [num_partitions]), rank)
    if t.startswith("manual"):
        return Tiling(np.zeros([1] * rank, dtype=int), rank, manual=True)
    if not t.startswith("devices="):
        return None  # maximal, unknown, shardy-only forms
    body = t[len("devices="):]
    try:
        m = re.match(r"(\[[\d,\s]*\]\s*(?:<=\s*\[[\d,\s]*\]\s*(?:T\([\d,\s]*\))?|[\d,\s]*))(.*)$", body, re.S)
        if not m:
            return None
        tiles = _tile_array(m.group(1).strip().rstrip(","))
        extra = m.group(2)
    except ValueError:
        return None
    manual, n_extra = False, 0
    if "last_tile_dims" in extra:
        kinds = re.search(r"last_tile_dims=\{([^}]*)\}", extra)
        manual = bool(kinds and "manual" in kinds.group(1))
        n_extra = len(kinds.group(1).split(",")) if kinds else 0
    elif "last_tile_dim_replicate" in extra:
        n_extra = 1
    if tiles.ndim != rank + n_extra:
        return None
    return Tiling(tiles, rank, manual=manual)


def tiling_spec(tiling: Tiling, mesh: MeshInfo) -> tuple[Entry, ...] | None:
    """The PartitionSpec-like entries of a tiling over the mesh axes; None if not expressible."""
    if tiling.manual:
        return None
    tiles = tiling.tiles
    if tiles.size != mesh.size:
        return None
    idx = np.indices(tiles.shape).reshape(tiles.ndim, -1)
    dev = tiles.reshape(-1)
    spec: list[Entry] = []
    used: set[str] = set()
    for d in range(tiling.rank):
        count = tiles.shape[d]
        index = np.empty(mesh.size, dtype=int)
        index[dev] = idx[d]
        axes = mesh.axes_for(index, count)
        if axes is None or used & set(axes):
            return None
        used |= set(axes)
        spec.append(axes)
    return tuple(spec)


# -- scalar evaluation (dynamic-slice offsets as functions of the partition id) -----------------------

class _NoEval(Exception):
    pass


def _literal(ins: Instr) -> np.ndarray:
    vals = re.findall(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?|true|false", ins.operand_text)
    conv = [1 if v == "true" else 0 if v == "false" else int(float(v)) for v in vals]
    shape = ins.shape or ()
    if len(conv) != math.prod(shape):
        raise _NoEval(ins.name)
    return np.array(conv, dtype=np.int64).reshape(shape)


def _evaluate(mod: HloModule, name: str, pid: int, memo: dict[str, np.ndarray], depth: int = 0) -> np.ndarray:
    if name in memo:
        return memo[name]
    ins = mod.op(name)
    if ins is None or depth > 64 or ins.shape is None or ins.etype is None or ins.etype.startswith("f"):
        raise _NoEval(name)
    if len(ins.shape) > 1:
        raise _NoEval(name)
    op = ins.opcode

    def arg(i: int) -> np.ndarray:
        return _evaluate(mod, ins.operands[i], pid, memo, depth + 1)

    binary = {"add": np.add, "subtract": np.subtract, "multiply": np.multiply,
              "maximum": np.maximum, "minimum": np.minimum}
    if op == "constant":
        v = _literal(ins)
    elif op == "partition-id":
        v = np.array(pid, dtype=np.int64)
    elif op == "replica-id":
        v = np.array(0, dtype=np.int64)
    elif op in ("copy", "convert", "bitcast", "reshape"):
        v = arg(0).reshape(ins.shape)
    elif op in binary:
        v = binary[op](arg(0), arg(1))
    elif op == "divide":
        a, b = arg(0), arg(1)
        if np.any(b == 0):
            raise _NoEval(name)
        v = np.trunc(a / b).astype(np.int64)
    elif op == "remainder":
        a, b = arg(0), arg(1)
        if np.any(b == 0):
            raise _NoEval(name)
        v = np.fmod(a, b)
    elif op == "clamp":
        v = np.clip(arg(1), arg(0), arg(2))
    elif op == "broadcast" and arg(0).ndim == 0:
        v = np.broadcast_to(arg(0), ins.shape).copy()
    elif op == "dynamic-slice":
        base = arg(0)
        if base.ndim != 1:
            raise _NoEval(name)
        size = ins.attr_ints("dynamic_slice_sizes")[0]
        start = int(np.clip(int(arg(1)), 0, base.shape[0] - size))
        v = base[start:start + size]
    else:
        raise _NoEval(name)
    memo[name] = v
    return v


def _per_partition(mod: HloModule, name: str) -> np.ndarray | None:
    try:
        return np.array([int(_evaluate(mod, name, p, {}).reshape(-1)[0]) for p in range(mod.num_partitions)])
    except _NoEval:
        return None


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


def _skip(skipped: list[tuple[str, str]], where: str, why: str) -> None:
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
        _skip(skipped, where, "a combined (tuple) all-gather")
        return None
    dims = cur.attr_ints("dimensions")
    src = mod.op(cur.operands[0])
    if len(dims) != 1 or src is None or src.shape is None:
        _skip(skipped, where, "cannot read the gathered dimension")
        return None
    d = dims[0]
    shape: Sequence[int] = cur.shape
    for ins in reversed(chain):
        nd = _forward(ins, shape, d)
        if nd is None:
            _skip(skipped, where, f"the gathered dimension does not survive {ins.opcode} {ins.name}")
            return None
        d, shape = nd, ins.shape or ()
    groups = parse_replica_groups(cur, mod.num_partitions)
    axes = mesh.group_axes(groups) if groups is not None else None
    if axes is None:
        _skip(skipped, where, f"replica groups {cur.attrs.get('replica_groups')!r} are not whole mesh axes")
        return None
    if cur.shape[dims[0]] != src.shape[dims[0]] * math.prod(mesh.as_dict()[a] for a in axes):
        _skip(skipped, where, "the gathered size does not match the group size")
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
        _skip(skipped, where, "a combined (tuple) collective")
        return None
    if not _is_add(mod, coll):
        _skip(skipped, where, "the reduction is not a sum")
        return None
    groups = parse_replica_groups(coll, mod.num_partitions)
    gaxes = mesh.group_axes(groups) if groups is not None else None
    if gaxes is None:
        _skip(skipped, where, f"replica groups {coll.attrs.get('replica_groups')!r} are not whole mesh axes")
        return None
    pre_shape = chain1[-1].shape if chain1 else dot.shape
    assert pre_shape is not None and dot.shape is not None
    if coll.opcode == "reduce-scatter":
        dims = coll.attr_ints("dimensions")
        if len(dims) != 1:
            _skip(skipped, where, "cannot read the scatter dimension")
            return None
        d = _back_through(chain1, dot.shape, dims[0])
        if d is None:
            _skip(skipped, where, "the scatter dimension does not survive the ops between dot and collective")
            return None
        return Pair("reduce_scatter", dot, coll, None, d, gaxes, "reduce-scatter")
    # all-reduce: its (only) consumer must be a dynamic-slice taking this device's block
    chain2, ds = _follow(mod, coll)
    if ds is None or ds.opcode != "dynamic-slice" or ds.shape is None:
        _skip(skipped, where, "the all-reduce result is used whole (an all-reduce layout, not decomposed)")
        return None
    base = chain2[-1].shape if chain2 else coll.shape
    assert base is not None
    diff = [i for i, (a, b) in enumerate(zip(base, ds.shape, strict=True)) if a != b]
    n = math.prod(mesh.as_dict()[a] for a in gaxes)
    if len(diff) != 1 or base[diff[0]] != ds.shape[diff[0]] * n:
        _skip(skipped, where, f"the dynamic-slice {ds.name} does not take one 1/{n} block of one dimension")
        return None
    e = diff[0]
    offsets = [_per_partition(mod, o) for o in ds.operands[1:]]
    axes = gaxes
    if all(o is not None for o in offsets) and len(offsets) == len(base):
        if any(np.any(o != 0) for i, o in enumerate(offsets) if i != e):
            _skip(skipped, where, "the dynamic-slice also moves along unsliced dimensions")
            return None
        off = offsets[e]
        assert off is not None
        block = off // ds.shape[e]
        if np.any(off % ds.shape[e]) or np.any(block < 0) or np.any(block >= n):
            _skip(skipped, where, "the dynamic-slice offsets are not block boundaries")
            return None
        found = mesh.axes_for(block, n)
        if found is None or set(found) != set(gaxes):
            _skip(skipped, where, "the blocks kept by each device do not follow the reduction group")
            return None
        axes = found
    else:
        log.debug("extract: %s: dynamic-slice offsets not evaluable; assuming group order", where)
    d = _back_through(chain2, coll.shape, e)
    d = _back_through(chain1, dot.shape, d) if d is not None else None
    if d is None:
        _skip(skipped, where, "the scatter dimension does not survive the ops between dot and slice")
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


# -- pairs -> Problems ---------------------------------------------------------------------------------

_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclass(frozen=True)
class DotDims:
    lc: tuple[int, ...]
    rc: tuple[int, ...]
    lb: tuple[int, ...]
    rb: tuple[int, ...]
    lrank: int
    rrank: int

    @classmethod
    def of(cls, mod: HloModule, dot: Instr) -> DotDims | None:
        a, b = mod.op(dot.operands[0]), mod.op(dot.operands[1])
        if a is None or b is None or a.shape is None or b.shape is None:
            return None
        return cls(dot.attr_ints("lhs_contracting_dims"), dot.attr_ints("rhs_contracting_dims"),
                   dot.attr_ints("lhs_batch_dims"), dot.attr_ints("rhs_batch_dims"), len(a.shape), len(b.shape))


def _letters(dims: DotDims, op_name: str) -> tuple[str, str, str]:
    """(lhs, rhs, out) subscripts of the dot; the einsum's own letters when its op_name has them."""
    m = re.search(r"([A-Za-z]+),([A-Za-z]+)->([A-Za-z]*)", op_name)
    tries: list[tuple[str, str]] = []
    if m:
        tries += [(m.group(1), m.group(2)), (m.group(2), m.group(1))]
    for lhs, rhs in tries:
        if len(lhs) != dims.lrank or len(rhs) != dims.rrank or len(set(lhs)) != len(lhs) or len(set(rhs)) != len(rhs):
            continue
        paired_l = set(dims.lc) | set(dims.lb)
        paired_r = set(dims.rc) | set(dims.rb)
        ok = all(lhs[i] == rhs[j] for i, j in zip(dims.lc + dims.lb, dims.rc + dims.rb, strict=True))
        ok = ok and not any(lhs[i] in rhs for i in range(len(lhs)) if i not in paired_l)
        ok = ok and not any(rhs[j] in lhs for j in range(len(rhs)) if j not in paired_r)
        if ok:
            return lhs, rhs, _out(dims, lhs, rhs)
    lhs = _LETTERS[: dims.lrank]
    rhs_l = []
    fresh = iter(_LETTERS[dims.lrank:])
    pair = dict(zip(dims.rc + dims.rb, dims.lc + dims.lb, strict=True))
    for j in range(dims.rrank):
        rhs_l.append(lhs[pair[j]] if j in pair else next(fresh))
    rhs = "".join(rhs_l)
    return lhs, rhs, _out(dims, lhs, rhs)


def _out(dims: DotDims, lhs: str, rhs: str) -> str:
    """HLO dot output order: batch dims, then lhs free dims, then rhs free dims."""
    lfree = [lhs[i] for i in range(dims.lrank) if i not in dims.lc and i not in dims.lb]
    rfree = [rhs[j] for j in range(dims.rrank) if j not in dims.rc and j not in dims.rb]
    return "".join([lhs[i] for i in dims.lb] + lfree + rfree)


def _local(shape: Sequence[int], spec: Sequence[Entry], sizes: Mapping[str, int],
           drop: tuple[int, tuple[str, ...]] | None = None) -> tuple[int, ...] | None:
    out = []
    for i, (d, e) in enumerate(zip(shape, spec, strict=True)):
        axes = e
        if drop is not None and drop[0] == i:
            axes = e[: len(e) - len(drop[1])]
        parts = math.prod(sizes[a] for a in axes)
        if d % parts:
            return None
        out.append(d // parts)
    return tuple(out)


def _with_axes(e: Entry, axes: tuple[str, ...]) -> Entry:
    return e if e[len(e) - len(axes):] == axes and len(e) >= len(axes) else tuple(e) + axes


def _spec_of(mod: HloModule, name: str, mesh: MeshInfo) -> tuple[Entry, ...] | str:
    ins = mod.op(name)
    if ins is None or ins.shape is None:
        return f"no instruction {name} in the propagated module"
    sh = ins.attrs.get("sharding")
    if sh is None:
        return tuple(() for _ in ins.shape)  # unannotated: replicated
    t = parse_sharding(sh, len(ins.shape), mod.num_partitions)
    if t is None:
        return f"cannot read sharding {sh!r} of {name}"
    if t.manual:
        return f"{name} is manually partitioned (inside shard_map)"
    spec = tiling_spec(t, mesh)
    if spec is None:
        return f"sharding {sh!r} of {name} is not a layout over whole mesh axes"
    return spec


def _problem_for(pair: Pair, post: HloModule, pre: HloModule, cand: Instr, mesh: MeshInfo) -> Problem | str:
    """The Problem of `pair` using `cand` (the dot in the propagated module); a reason if none."""
    dims = DotDims.of(pre, cand)
    post_dims = DotDims.of(post, pair.dot)
    if dims is None or dims != post_dims:
        return "dimension numbers differ"
    lhs_i, rhs_i = pre.instrs[cand.operands[0]], pre.instrs[cand.operands[1]]
    if lhs_i.etype not in DTYPES or rhs_i.etype != lhs_i.etype:
        return f"operand types {lhs_i.etype}/{rhs_i.etype} (supported: {', '.join(DTYPES)}, both alike)"
    if any(ins.shape is None for ins in (lhs_i, rhs_i, cand)):
        return "tuple-shaped operands"
    ls, rs, os_ = (_spec_of(pre, n, mesh) for n in (cand.operands[0], cand.operands[1], cand.name))
    for s in (ls, rs, os_):
        if isinstance(s, str):
            return s
    assert not isinstance(ls, str) and not isinstance(rs, str) and not isinstance(os_, str)
    lspec, rspec, ospec = list(ls), list(rs), list(os_)
    sizes = mesh.as_dict()
    lpost = post.instrs[pair.dot.operands[0]].shape
    rpost = post.instrs[pair.dot.operands[1]].shape
    assert lhs_i.shape is not None and rhs_i.shape is not None and cand.shape is not None
    lshape, rshape, oshape = lhs_i.shape, rhs_i.shape, cand.shape
    ldrop = rdrop = odrop = None
    if pair.kind == "all_gather":
        spec = lspec if pair.operand == "lhs" else rspec
        spec[pair.dim] = _with_axes(spec[pair.dim], pair.axes)
        if pair.operand == "lhs":
            ldrop = (pair.dim, pair.axes)
        else:
            rdrop = (pair.dim, pair.axes)
    else:
        ospec[pair.dim] = _with_axes(ospec[pair.dim], pair.axes)
        odrop = (pair.dim, pair.axes)
    if (_local(lshape, lspec, sizes, ldrop) != lpost or _local(rshape, rspec, sizes, rdrop) != rpost
            or _local(oshape, ospec, sizes, odrop) != pair.dot.shape):
        return "the propagated shardings do not give the partitioned dot's per-device shapes"
    lhs, rhs, out = _letters(dims, cand.op_name)
    d = {"equation": f"{lhs},{rhs}->{out}",
         "lhs": {"shape": list(lshape), "spec": [_json(e) for e in lspec]},
         "rhs": {"shape": list(rshape), "spec": [_json(e) for e in rspec]},
         "out_spec": [_json(e) for e in ospec],
         "dtype": DTYPES[lhs_i.etype], "mesh": sizes}
    try:
        p = Problem.from_dict(d)
    except ProblemError as e:
        return f"not a Problem: {e}"
    pat = p.pattern
    want_letter = ((lhs if pair.operand == "lhs" else rhs)[pair.dim] if pair.kind == "all_gather"
                   else out[pair.dim])
    if (pat.kind != pair.kind or pat.letter != want_letter or len(pair.axes) != 1 or pat.axis != pair.axes[0]
            or (pair.kind == "all_gather" and pat.operand != pair.operand)):
        return (f"the layout classifies as {pat.label} over {pat.axis}, not the {pair.form} of "
                f"{want_letter!r} over {'/'.join(pair.axes)} that the HLO shows")
    return p


def _json(e: Entry) -> str | list[str] | None:
    return None if not e else e[0] if len(e) == 1 else list(e)


def _signature(mod: HloModule, dot: Instr) -> tuple[Any, ...]:
    return (dot.op_name, dot.stack_frame, DotDims.of(mod, dot))


def extract_from_hlo(propagated: str, partitioned: str, mesh: Mapping[str, int] | MeshInfo) -> ExtractReport:
    """Problems from the two HLO texts (before and after `spmd-partitioning`) of one module."""
    info = mesh if isinstance(mesh, MeshInfo) else MeshInfo(tuple(mesh), tuple(mesh.values()))
    post, pre = parse_hlo(partitioned), parse_hlo(propagated)
    skipped: list[tuple[str, str]] = []
    if post.num_partitions != info.size:
        raise ExtractError(f"the module runs on {post.num_partitions} partitions but the mesh "
                           f"{info.as_dict()} has {info.size} devices")
    pairs = find_pairs(post, info, skipped)
    times = _multiplicity(post)
    pre_dots = [pre.instrs[n] for n in pre.order if pre.instrs[n].opcode == "dot"]
    used: set[str] = set()
    found: dict[str, list[Any]] = {}
    for pair in pairs:
        where = pair.where()
        if pair.dot.computation in _manual_computations(post):
            _skip(skipped, where, "inside shard_map (already manually partitioned)")
            continue
        sig = _signature(post, pair.dot)
        reasons = []
        result: Problem | None = None
        # same op_name/stack frame/dimension numbers first, then any dot of the same dimensions
        cands = ([c for c in pre_dots if _signature(pre, c) == sig]
                 + [c for c in pre_dots if _signature(pre, c) != sig and _signature(pre, c)[2] == sig[2]])
        for cand in cands:
            if cand.name in used:
                continue
            r = _problem_for(pair, post, pre, cand, info)
            if isinstance(r, Problem):
                result = r
                used.add(cand.name)
                break
            reasons.append(r)
        if result is None:
            _skip(skipped, where, reasons[0] if reasons else "no matching dot in the propagated module")
            continue
        slot = found.setdefault(result.key, [result, 0])
        slot[1] += times.get(pair.dot.computation, 1)
        log.debug("extract: %s -> %s", where, result.describe())
    problems = [(p, c) for p, c in found.values()]
    return ExtractReport(problems, skipped, len(pairs), post.num_partitions, info.as_dict())


def _trip_count(mod: HloModule, w: Instr) -> int | None:
    """Iterations of a counted while loop (the form jax's scan/fori_loop lower to), else None."""
    cond = mod.computations.get(w.attrs.get("condition", "").lstrip("%"), [])
    body = mod.computations.get(w.attrs.get("body", "").lstrip("%"), [])
    init = mod.op(w.operands[0]) if w.operands else None
    if not cond or not body or init is None or init.opcode != "tuple":
        return None
    root = mod.instrs[cond[-1]]
    if root.opcode != "compare" or len(root.operands) != 2:
        return None
    a, b = (mod.op(o) for o in root.operands)
    d = root.attrs.get("direction", "")
    if a is None or b is None:
        return None
    if a.opcode == "constant" and b.opcode == "get-tuple-element":
        a, b = b, a
        d = {"GT": "LT", "GE": "LE", "LT": "GT", "LE": "GE"}.get(d, d)
    if a.opcode != "get-tuple-element" or b.opcode != "constant" or d not in ("LT", "LE"):
        return None
    i = a.attr_ints("index")[0] if a.attr_ints("index") else -1
    broot = mod.instrs[body[-1]]
    if broot.opcode != "tuple" or not 0 <= i < len(broot.operands) or i >= len(init.operands):
        return None
    step = mod.op(broot.operands[i])
    start = mod.op(init.operands[i])
    if step is None or start is None or start.opcode != "constant" or step.opcode != "add":
        return None
    ops = [mod.op(o) for o in step.operands]
    incs = [o for o in ops if o is not None and o.opcode == "constant"]
    gtes = [o for o in ops if o is not None and o.opcode == "get-tuple-element" and o.attr_ints("index") == (i,)]
    if len(incs) != 1 or len(gtes) != 1:
        return None
    try:
        k0, n, inc = (int(_literal(x).reshape(-1)[0]) for x in (start, b, incs[0]))
    except _NoEval:
        return None
    if inc <= 0:
        return None
    n += d == "LE"
    return max(0, -(-(n - k0) // inc))


def _multiplicity(mod: HloModule) -> dict[str, int]:
    """Computation -> how many times it runs per program call (loop bodies times their trips)."""
    callers: dict[str, list[tuple[str, int]]] = {}
    for n in mod.order:
        ins = mod.instrs[n]
        if ins.opcode == "while":
            trips = _trip_count(mod, ins)
            if trips is None:
                log.debug("extract: loop %s has no countable trip count; its pairs count once", n)
            callers.setdefault(ins.attrs.get("body", "").lstrip("%"), []).append(
                (ins.computation, 1 if trips is None else trips))
        elif ins.opcode in ("call", "conditional", "async-start"):
            for key in ("to_apply", "calls", "branch_computations", "true_computation", "false_computation"):
                for c in re.findall(r"%?([\w.\-]+)", ins.attrs.get(key, "")):
                    callers.setdefault(c, []).append((ins.computation, 1))
    memo: dict[str, int] = {}

    def mult(c: str, depth: int = 0) -> int:
        if c in memo:
            return memo[c]
        if depth > 32 or c not in callers:
            return 1
        memo[c] = sum(mult(p, depth + 1) * k for p, k in callers[c])
        return memo[c]

    return {c: mult(c) for c in mod.computations}


def _manual_computations(mod: HloModule) -> set[str]:
    """Computations whose dots run on manually partitioned (shard_map) values."""
    out = set()
    for n in mod.order:
        ins = mod.instrs[n]
        if ins.opcode == "custom-call" and "SPMDFullToShardShape" in ins.attrs.get("custom_call_target", ""):
            out.add(ins.computation)
    return out


# -- compiling ----------------------------------------------------------------------------------------

def _leaves(tree: Any) -> list[Any]:
    import jax

    return jax.tree_util.tree_leaves(tree)


def _mesh_from_args(args: Sequence[Any], kwargs: Mapping[str, Any]) -> MeshInfo | None:
    from jax.sharding import NamedSharding

    found: MeshInfo | None = None
    for leaf in _leaves((tuple(args), dict(kwargs))):
        sh = getattr(leaf, "sharding", None)
        if isinstance(sh, NamedSharding):
            m = sh.mesh
            info = MeshInfo(tuple(m.axis_names), tuple(int(s) for s in m.axis_sizes))
            if found is not None and found != info:
                raise ExtractError(f"the example arguments use two meshes: {found.as_dict()} and "
                                   f"{info.as_dict()}; pass mesh=")
            found = info
    return found


def _mesh_info(mesh: Any) -> MeshInfo:
    if isinstance(mesh, MeshInfo):
        return mesh
    if isinstance(mesh, Mapping):
        return MeshInfo(tuple(mesh), tuple(int(v) for v in mesh.values()))
    names = getattr(mesh, "axis_names", None)
    if names is None:
        raise ExtractError(f"mesh must be a jax Mesh or a mapping axis -> size, got {type(mesh).__name__}")
    return MeshInfo(tuple(names), tuple(int(s) for s in mesh.axis_sizes))


@contextlib.contextmanager
def _dump_dir() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="autotuner-extract-") as d:
        yield d


def partitioned_hlo(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[str, str, int]:
    """(propagated, partitioned, num_partitions): the HLO text before and after XLA's SPMD
    partitioner for `fn` compiled with the example arguments. For a one-device program, where the
    partitioner does not run, both texts are ''."""
    import jax

    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    try:
        lowered = jitted.lower(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - report what the user's function did
        raise ExtractError(f"could not lower the function with the example arguments: {e}") from e
    with _dump_dir() as d:
        opts = {"xla_dump_to": d, "xla_dump_hlo_pass_re": "spmd-partitioning",
                "xla_dump_hlo_as_text": True, "xla_dump_hlo_as_proto": False}
        try:
            lowered.compile(compiler_options=opts)
        except Exception as e:  # noqa: BLE001
            raise ExtractError(f"could not compile the function: {e}") from e
        files = sorted(glob.glob(os.path.join(d, "*.txt")))
        module = lambda f: os.path.basename(f).split(".")[0]  # noqa: E731 - module_NNNN
        before = [f for f in files if "before_spmd-partitioning" in os.path.basename(f)]
        after = [f for f in files if "after_spmd-partitioning" in os.path.basename(f)]
        both = sorted({module(f) for f in before} & {module(f) for f in after})
        if both:  # one module per compile; if XLA dumped several, the last compiled is ours
            before = [f for f in before if module(f) == both[-1]]
            after = [f for f in after if module(f) == both[-1]]
        if not before or not after:
            head = next((f for f in files if f.endswith("before_optimizations.txt")), None)
            parts = 1
            if head:
                with open(head) as fh:
                    m = re.search(r"num_partitions=(\d+)", fh.readline())
                parts = int(m.group(1)) if m else 1
            if parts > 1:
                raise ExtractError("XLA did not dump the module around spmd-partitioning (is the persistent "
                                   "compilation cache answering? set JAX_ENABLE_COMPILATION_CACHE=false)")
            return "", "", parts
        with open(before[-1]) as fh:
            pre = fh.read()
        with open(after[-1]) as fh:
            post = fh.read()
    m = re.search(r"num_partitions=(\d+)", post.split("\n", 1)[0])
    return pre, post, int(m.group(1)) if m else 1


def extract_report(fn: Callable[..., Any], *args: Any, mesh: Any = None, **kwargs: Any) -> ExtractReport:
    """Like `extract`, with the pairs that could not be mapped and why."""
    info = _mesh_info(mesh) if mesh is not None else _mesh_from_args(args, kwargs)
    pre, post, parts = partitioned_hlo(fn, *args, **kwargs)
    if parts <= 1 or not post:
        log.debug("extract: the program runs on one device: no collectives")
        return ExtractReport([], [], 0, parts, info.as_dict() if info else {})
    if info is None:
        raise ExtractError(f"the program is partitioned {parts} ways but no example argument has a "
                           "NamedSharding; pass mesh=")
    return extract_from_hlo(pre, post, info)


def extract(fn: Callable[..., Any], *args: Any, mesh: Any = None, **kwargs: Any) -> list[tuple[Problem, int]]:
    """[(Problem, count), ...] for the all-gather -> einsum and einsum -> reduce-scatter pairs of
    `fn` compiled with the example arguments (arrays or `jax.ShapeDtypeStruct`s with shardings).

    `fn` may be jitted already (static arguments then work as usual); `kwargs` go to `fn` (`mesh` is
    extract's own keyword: bind a function's own `mesh` argument with functools.partial). The mesh
    comes from the arguments' `NamedSharding`s unless `mesh` (a jax Mesh or {axis: size}) is given.
    Problems come in order of first occurrence; the same Problem key twice counts 2. Pairs that do
    not map to a Problem are skipped (logged at debug level; `extract_report` lists them).
    """
    return extract_report(fn, *args, mesh=mesh, **kwargs).problems


class _CallableModule(type(sys.modules[__name__])):  # type: ignore[misc]
    """`autotuner.extract(fn, *args)` works even where `autotuner.extract` is this module (the
    submodule and the function share the name, and importing one binds the other)."""

    def __call__(self, fn: Callable[..., Any], *args: Any, mesh: Any = None, **kwargs: Any
                 ) -> list[tuple[Problem, int]]:
        return extract(fn, *args, mesh=mesh, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

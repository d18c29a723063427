"""A traced dot as the pass records it (`DotInfo`), and how it computes the Problem read from
XLA's HLO where XLA changed the dot before its partitioner (`View`): its operands exchanged
(XLA:TPU reorders the operands of some backward dots), a `transpose` that gives an operand folded
into the dot (XLA's transpose folding: XLA:TPU reads a tied embedding's table itself in the LM
head's `x @ table.T`), or both. `overlap.find` matches the `views` of a traced dot against the
Problem; `overlap.apply` takes the Problem's operands and gives back the traced result through
the one that matched.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import jax.numpy as jnp

from autotuner.problem import Entry

Perm = tuple[int, ...]
Spec = tuple[Entry, ...]


@dataclass
class DotInfo:
    """What tag mode records of one dot_general equation."""

    tag: str
    lhs_shape: tuple[int, ...]
    rhs_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    dtypes: tuple[str, str, str]                       # lhs, rhs, out
    dims: tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]]
    where: str                                         # user source file:line (function)
    lhs_chain: list[Spec | None] = field(default_factory=list)   # layouts along the look-through
    rhs_chain: list[Spec | None] = field(default_factory=list)
    out_spec: Spec | None = None
    out_relayouts: list[Spec | None] = field(default_factory=list)  # layouts of elidable consumers
    out_used_as_is: bool = False       # the result is also used as laid out (not only relaid out)
    lhs_transpose: Perm | None = None  # the permutation of a `transpose` that gives the operand
    rhs_transpose: Perm | None = None  # (before any relayout): XLA may fold it into the dot


@dataclass(frozen=True)
class View:
    """`swapped`: the traced dot's operands exchanged; `lhs`/`rhs`: the axes (`jnp.transpose`) that
    give the Problem's lhs/rhs from the traced operand it is (a folded transpose's input); `out`:
    the axes that give the traced dot's result from the Problem's. All defaults: the traced dot."""

    swapped: bool = False
    lhs: Perm | None = None
    rhs: Perm | None = None
    out: Perm | None = None

    def transposes(self, operand: str) -> bool:
        """Whether the Problem's `operand` ("lhs" or "rhs") is a transpose of the traced one."""
        return (self.lhs if operand == "lhs" else self.rhs) is not None

    def to_dict(self) -> dict[str, Any]:
        return {"swapped": self.swapped, "lhs": self.lhs, "rhs": self.rhs, "out": self.out}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> View:
        perm = lambda p: None if p is None else tuple(int(i) for i in p)  # noqa: E731
        return View(bool(d["swapped"]), perm(d["lhs"]), perm(d["rhs"]), perm(d["out"]))


IDENTITY = View()   # the traced dot as it is


def permute(x: Any, axes: Perm | None) -> Any:
    return x if axes is None else jnp.transpose(x, axes)


def views(info: DotInfo) -> list[tuple[DotInfo, View]]:
    """The traced dot as XLA's HLO may have it before the partitioner, each with its `View`: its
    operands exchanged (XLA:TPU reorders the operands of some backward dots), a `transpose` that
    gives an operand folded into the dot (XLA's transpose folding: the HLO dot reads the
    transpose's input), or both; the fewest changes first. Each is the same product, so any view
    that matches the Problem computes the traced dot."""
    folds = [(ql, qr) for ql in (None, info.lhs_transpose) for qr in (None, info.rhs_transpose)]
    return [_view(info, swapped, ql, qr) for ql, qr in dict.fromkeys(folds) for swapped in (False, True)
            if swapped or ql or qr]


class _Operand(NamedTuple):
    """One operand of a view: the transpose's input in place of the traced operand."""

    shape: tuple[int, ...]
    contracting: tuple[int, ...]
    batch: tuple[int, ...]
    traced_free: list[tuple[str, int]]   # its free dimensions' labels, in the traced operand's order
    free: list[tuple[str, int]]          # the same, in the input's order
    axes: Perm | None                    # jnp.transpose axes: traced operand -> input (None: the same)


def _operand(shape: tuple[int, ...], q: Perm | None, c: tuple[int, ...], b: tuple[int, ...], side: str) -> _Operand:
    """The input of a transpose of permutation `q` (the traced operand's dimension i is its q[i];
    None: no transpose) that gives an operand of shape `shape`, contracting `c` and batch `b`."""
    q = q or tuple(range(len(shape)))
    dims = [0] * len(shape)
    for i, j in enumerate(q):
        dims[j] = shape[i]
    free = [i for i in range(len(shape)) if i not in c and i not in b]
    axes = tuple(sorted(range(len(q)), key=lambda i: q[i]))
    return _Operand(tuple(dims), tuple(q[i] for i in c), tuple(q[i] for i in b), [(side, i) for i in free],
                    [(side, i) for i in sorted(free, key=lambda i: q[i])],
                    None if axes == tuple(range(len(q))) else axes)


def _view(info: DotInfo, swapped: bool, ql: Perm | None, qr: Perm | None) -> tuple[DotInfo, View]:
    """The dot that reads the transposes' inputs (`ql`/`qr`: their permutations, `_operand`), its
    operands exchanged if `swapped`, its result in dot_general's order (batch, then its lhs's free
    dimensions, then its rhs's)."""
    (lc, rc), (lb, rb) = info.dims
    lhs, rhs = _operand(info.lhs_shape, ql, lc, lb, "l"), _operand(info.rhs_shape, qr, rc, rb, "r")
    batch = [("b", k) for k in range(len(lb))]
    traced = batch + lhs.traced_free + rhs.traced_free
    first, second = (rhs, lhs) if swapped else (lhs, rhs)
    labels = batch + first.free + second.free
    out = tuple(labels.index(t) for t in traced)
    dtypes = (info.dtypes[1], info.dtypes[0], info.dtypes[2]) if swapped else info.dtypes
    seen = replace(info, lhs_shape=first.shape, rhs_shape=second.shape, dtypes=dtypes,
                   out_shape=tuple(info.out_shape[traced.index(t)] for t in labels),
                   dims=((first.contracting, second.contracting), (first.batch, second.batch)))
    return seen, View(swapped, first.axes, second.axes, None if out == tuple(range(len(out))) else out)

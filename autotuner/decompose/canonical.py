"""The matmul a Problem is: size-1 letters dropped, letters that travel together merged.

A ring moves and multiplies blocks of the local arrays. When an einsum names more dimensions
than its matmul has (`bsd,df->bsf` with b = 1; `bshk,hkd->bsd` where h and k are always
adjacent), the ring built on it carries rank-3/4 buffers whose chunk slices are strided, and
XLA:CPU materialises them twice (once for the send, once, bitcast to 2-D, for the dot). Seen on
`bsd,df->bsf`, chunks=2: two extra slice fusions in the program and a different thunk order
from the same matmul posed as `sd,df->sf`.

`canonical(problem)` poses the same computation with fewer letters, so that the ring runs on
the 2-D (or batched 2-D) form and the result is reshaped back once:
- a letter of size 1 that no operand shards is dropped (its index is always 0);
- two letters a, b (b right after a) merge into a when every array that has one has both,
  adjacent in that order, and no array shards b. a keeps its sharding, so the merged letter's
  blocks are a's blocks times b: contiguous in every local array. The per-device arrays of the
  merged problem are those of the original, reshaped (a bitcast: no copy).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax

from autotuner.problem import Problem


def local_shape(problem: Problem, which: str) -> tuple[int, ...]:
    """Per-device shape of 'lhs', 'rhs' or 'out'."""
    mesh = problem.mesh_shape
    shape, spec = {"lhs": (problem.lhs.shape, problem.lhs.spec), "rhs": (problem.rhs.shape, problem.rhs.spec),
                   "out": (problem.out_shape, problem.out_spec)}[which]
    return tuple(d // math.prod(mesh[a] for a in e) for d, e in zip(shape, spec, strict=True))


def _arrays(p: Problem) -> list[tuple[str, tuple, tuple]]:
    """(letters, global shape, spec) of lhs, rhs and out."""
    eq = p.eq
    return [(eq.lhs, p.lhs.shape, p.lhs.spec), (eq.rhs, p.rhs.shape, p.rhs.spec), (eq.out, p.out_shape, p.out_spec)]


def _sharded(p: Problem, c: str) -> bool:
    return any(spec[letters.index(c)] for letters, _, spec in _arrays(p) if c in letters)


def _droppable(p: Problem, c: str) -> bool:
    return p.sizes[c] == 1 and not _sharded(p, c)


def _mergeable(p: Problem, drop: set[str], a: str, b: str) -> bool:
    """b can fold into a: in every array (less the dropped letters) both or neither, b right
    after a; and no array shards b."""
    if _sharded(p, b):
        return False
    for letters, _, _ in _arrays(p):
        kept = [c for c in letters if c not in drop]
        if (a in kept) != (b in kept):
            return False
        if a in kept and kept.index(b) != kept.index(a) + 1:
            return False
    return True


def canonical(problem: Problem) -> Problem | None:
    """The same computation with the fewest letters the rules above allow; None when that is
    `problem` itself. No operand loses its last letter."""
    p = problem
    drop = {c for c in set(p.eq.lhs + p.eq.rhs) if _droppable(p, c)}
    for letters, _, _ in _arrays(p):
        if letters and all(c in drop for c in letters):  # keep a letter of an array that would vanish
            drop.discard(letters[0])
    root: dict[str, str] = {}  # merged letter -> the letter it folds into
    for letters, _, _ in _arrays(p):
        kept = [c for c in letters if c not in drop]
        for a, b in zip(kept, kept[1:], strict=False):
            if b not in root and _mergeable(p, drop, a, b):
                root[b] = root.get(a, a)
    if not drop and not root:
        return None
    return _rewrite(p, drop, root)


def _rewrite(p: Problem, drop: set[str], root: dict[str, str]) -> Problem:
    """`p` without the letters in `drop` and with every key of `root` folded into its value."""
    sizes = dict(p.sizes)
    for b, a in root.items():
        sizes[a] *= sizes[b]

    def operand(letters: str, spec: tuple) -> tuple[str, list[int], list]:
        keep = [c for c in letters if c not in drop and c not in root]
        js = [None if not e else e[0] if len(e) == 1 else list(e) for e in (spec[letters.index(c)] for c in keep)]
        return "".join(keep), [sizes[c] for c in keep], js

    (ll, ls, lsp), (rl, rs, rsp), (ol, _, osp) = (operand(letters, spec) for letters, _, spec in _arrays(p))
    return Problem.from_dict({
        "equation": f"{ll},{rl}->{ol}", "lhs": {"shape": ls, "spec": lsp}, "rhs": {"shape": rs, "spec": rsp},
        "out_spec": osp, "dtype": p.dtype, "mesh": dict(p.mesh)})


def on_canonical(problem: Problem, make: Callable[[Problem], Callable[[jax.Array, jax.Array], jax.Array]]
                 ) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """The per-device function `make(problem)`, built on the canonical form when there is one:
    the local operands are reshaped in, the local result reshaped out (bitcasts, no copies)."""
    cp = canonical(problem)
    if cp is None:
        return make(problem)
    inner = make(cp)
    lhs_c, rhs_c, out = local_shape(cp, "lhs"), local_shape(cp, "rhs"), local_shape(problem, "out")

    def local(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        return inner(lhs.reshape(lhs_c), rhs.reshape(rhs_c)).reshape(out)

    return local

"""Shared pieces of the strategies: the per-device layout, ring permutations, loops, einsums."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from autotuner.problem import Entry, Equation, Problem, ProblemError

LOW_PRECISION = ("bfloat16", "float16")


def pspec(spec: Sequence[Entry]) -> PartitionSpec:
    return PartitionSpec(*[None if not e else e[0] if len(e) == 1 else tuple(e) for e in spec])


def check_mesh(problem: Problem, mesh: Mesh) -> None:
    got = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
    if got != problem.mesh_shape:
        raise ProblemError("mesh", f"the problem's mesh {problem.mesh_shape} does not match the "
                                   f"given jax Mesh {got}")


def constrain(x: jax.Array, mesh: Mesh, spec: PartitionSpec) -> jax.Array:
    """Lay `x` out as `spec` inside jit, for explicit and auto meshes alike."""
    if all(t == AxisType.Explicit for t in mesh.axis_types):
        return jax.reshard(x, NamedSharding(mesh, spec))
    return lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def wrap(problem: Problem, mesh: Mesh, local_fn: Callable[[jax.Array, jax.Array], jax.Array],
         out_spec: Sequence[Entry] | None = None) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """A jittable function of the global arrays running `local_fn` per device via shard_map.
    `out_spec` (default: the problem's) is the spec of what `local_fn` returns."""
    check_mesh(problem, mesh)
    os_ = pspec(problem.out_spec if out_spec is None else out_spec)
    ls, rs = pspec(problem.lhs.spec), pspec(problem.rhs.spec)
    mapped = jax.shard_map(local_fn, mesh=mesh, in_specs=(ls, rs), out_specs=os_, check_vma=False)
    dtype = jnp.dtype(problem.dtype)

    def fn(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        lhs = constrain(jnp.asarray(lhs, dtype), mesh, ls)
        rhs = constrain(jnp.asarray(rhs, dtype), mesh, rs)
        return mapped(lhs, rhs)

    return fn


@dataclass(frozen=True)
class Layout:
    """What one device sees of a Problem whose collective runs over `axis` (size n)."""

    problem: Problem
    axis: str
    n: int

    @property
    def eq(self):  # noqa: ANN201 - the Equation
        return self.problem.eq

    @property
    def dtype(self) -> Any:
        return jnp.dtype(self.problem.dtype)

    @property
    def low_precision(self) -> bool:
        return self.problem.dtype in LOW_PRECISION

    def local_extent(self, operand: str, letter: str) -> int:
        """Per-device size of `letter` in `operand` ('lhs', 'rhs' or 'out')."""
        p, mesh = self.problem, self.problem.mesh_shape
        letters, shape, spec = {
            "lhs": (p.eq.lhs, p.lhs.shape, p.lhs.spec),
            "rhs": (p.eq.rhs, p.rhs.shape, p.rhs.spec),
            "out": (p.eq.out, p.out_shape, p.out_spec),
        }[operand]
        i = letters.index(letter)
        return shape[i] // math.prod(mesh[a] for a in spec[i])

    def einsum(self, lhs: jax.Array, rhs: jax.Array, *, f32: bool = False) -> jax.Array:
        """The problem's einsum of these local pieces (float32 result with `f32`)."""
        return einsum(self.eq, lhs, rhs, jnp.float32 if f32 else None)

    def right(self) -> list[tuple[int, int]]:
        """Device j sends to j+1."""
        return [(j, (j + 1) % self.n) for j in range(self.n)]

    def left(self) -> list[tuple[int, int]]:
        """Device j sends to j-1."""
        return [(j, (j - 1) % self.n) for j in range(self.n)]

    def send(self, xs: Sequence[jax.Array], perm: list[tuple[int, int]]) -> list[jax.Array]:
        return [lax.ppermute(x, self.axis, perm) for x in xs]


def block(i: Any, off: Any, n: int) -> Any:
    """(i + off) mod n, never negative: the block that device `i` (traced, in [0, n)) holds or
    computes at ring offset `off`. Lean on purpose: every ring step of every decomposed pair
    lowers this, and the rewritten program's compile time grows with its instruction count
    (jnp's `%` lowers to a call of a dozen ops that also fix the sign of a negative divisor)."""
    if isinstance(off, int):
        off %= n
        if off == 0:
            return i
        if n == 2:                         # the other device: one op, not four
            return 1 - i
        j = i + off                        # in [0, 2n): one wrap, no remainder (XLA expands a
        return lax.select(j >= n, j - n, j)  # signed one into a handful of ops)
    return lax.rem(lax.rem(i + off, n) + n, n)   # a traced offset (a rolled loop) may be negative


class Block:
    """A constant ring offset's block index (traced) and the element offsets computed from it
    (`block_start`), each computed once: every member of a grouped ring, and each step's partial
    einsums and its write into the output, start at the same places."""

    def __init__(self, index: Any):
        self.index = index
        self.starts: dict[tuple[int, int], Any] = {}


class Blocks:
    """`block(i, off, n)` for one ring's device index `i`, each constant offset computed once
    (a `Block`). Constant offsets occur outside rolled loops only (inside one the step is traced),
    so nothing computed here outlives its trace."""

    def __init__(self, i: Any, n: int):
        self.i, self.n = i, n
        self._memo: dict[int, Block] = {}

    def __call__(self, off: Any) -> Any:
        if not isinstance(off, int):
            return block(self.i, off, self.n)
        off %= self.n
        if off not in self._memo:
            self._memo[off] = Block(block(self.i, off, self.n))
        return self._memo[off]


def block_start(b: Any, size: int, plus: int = 0) -> Any:
    """Where block `b` (traced, or a `Block`) of `size` elements starts, `plus` elements further."""
    if isinstance(b, Block):
        key = (size, plus)
        if key not in b.starts:
            b.starts[key] = block_start(b.index, size, plus)
        return b.starts[key]
    start = b * size
    return start + plus if plus else start


@functools.cache
def _dot_form(eq: Equation) -> tuple[Any, tuple[int, ...] | None]:
    """`eq` as `lax.dot_general` dimension numbers and the permutation of its result into the
    output's letter order (None when already in it)."""
    batch, contract = eq.batch, eq.contracting
    dims = ((tuple(eq.lhs.index(c) for c in contract), tuple(eq.rhs.index(c) for c in contract)),
            (tuple(eq.lhs.index(c) for c in batch), tuple(eq.rhs.index(c) for c in batch)))
    got = list(batch) + [c for c in eq.lhs if c not in eq.rhs] + [c for c in eq.rhs if c not in eq.lhs]
    perm = tuple(got.index(c) for c in eq.out)
    return dims, None if perm == tuple(range(len(perm))) else perm


def einsum(eq: Equation, lhs: jax.Array, rhs: jax.Array, preferred: Any = None) -> jax.Array:
    """`jnp.einsum(str(eq), lhs, rhs, preferred_element_type=preferred)` as one `dot_general`
    (and a transpose where the output's order asks): the same program, without jnp.einsum's
    contraction-path search on every call, which the rings make hundreds of in a large step
    (`parse_equation` rules out repeated and lone summed letters, the cases that need more)."""
    dims, perm = _dot_form(eq)
    out = lax.dot_general(lhs, rhs, dims, preferred_element_type=preferred)
    return out if perm is None else lax.transpose(out, perm)


def slice_dim(x: jax.Array, letters: str, letter: str, start: Any, size: int) -> jax.Array:
    """`x` sliced along `letter` if it has it; unchanged otherwise. `start` is never negative
    (`block`), so the slice needs no wrap-around of negative indices."""
    if letter not in letters:
        return x
    return lax.dynamic_slice_in_dim(x, start, size, letters.index(letter), allow_negative_indices=False)


def split(x: jax.Array, parts: int, dim: int) -> list[jax.Array]:
    return list(jnp.split(x, parts, axis=dim)) if parts > 1 else [x]


def run_loop(body: Callable[[Any, Any], tuple[Any, Any]], carry: Any, lo: int, hi: int,
             unroll: int | str) -> tuple[Any, list[Any]]:
    """Run body(carry, t) for t in [lo, hi): a Python loop for unroll='full', else lax.scan.

    Returns the final carry and the per-step outputs as a list (for scan: a one-element list
    holding the outputs stacked along a new leading axis, or [] when the body emits none).
    """
    if hi <= lo:
        return carry, []
    if unroll == "full":
        ys = []
        for t in range(lo, hi):
            carry, y = body(carry, t)
            if y is not None:
                ys.append(jax.tree.map(lambda a: a[None], y))
        return carry, ys
    carry, y = lax.scan(body, carry, jnp.arange(lo, hi), unroll=int(unroll))
    return carry, ([] if y is None else [y])


def loop_trips(p: Problem, direction: str) -> int:
    """Iterations of the rolled loop (the rest of the steps are peeled)."""
    n = p.axis_size
    if direction == "uni":
        return n - 1
    return (n - 1) // 2 - 1


def after(dep: Any) -> Any:
    """int32 0 computed from one element of each array in `dep` (None: Python 0). Added to a
    slice offset, it makes the slice (so the einsum reading it) wait until `dep` is computed.
    `x * 0 > 1` is false for every float x, NaN and inf included (x * 0 is then NaN), and XLA
    cannot fold it: x * 0 of a float is not 0 when x is not finite."""
    zero: Any = 0
    for x in jax.tree.leaves(dep):
        zero = zero + (x.reshape(-1)[0] * 0 > 1).astype(jnp.int32)
    return zero


def held(xs: Sequence[jax.Array], dep: Any) -> list[jax.Array]:
    """`xs` unchanged, but computed only once `dep` is: each plus `after(dep)` (an int32 0 that XLA
    cannot fold). A serial control (`Strategy.serial`) holds a step's einsum input until its
    transfer has arrived, or a transfer until the einsum before it is done, so nothing overlaps."""
    wait = after(dep)
    if isinstance(wait, int):
        return list(xs)
    return [x + wait.astype(x.dtype) for x in xs]

"""One all-gather feeding k einsums (a `GroupedProblem`), as pure functions of (problem, strategy, mesh).

- baseline: the operand gathered once, then the k plain einsums (what GSPMD emits);
- ring: one ring loop of CollectivePermutes drives all k einsums: every step moves each shard (or
  chunk) of the shared operand once and multiplies it by every weight while the next one is in
  flight. The knobs are those of a single all-gather ring (`autotuner.decompose.allgather`):
  direction, chunks, unroll, fuse and send_first, with the same meaning; the partial einsums of
  member m are those of the single ring of member m (the same `_AG` pieces), so a group of one
  would be exactly that ring.

A built function takes the global arrays `(x, w_1, ..., w_k)`: the shared operand first, then each
member's other operand, whichever side of its equation either stands on; it returns the k
results as a tuple, each laid out as its member's `out_spec`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh

from autotuner.decompose._common import (
    Layout,
    check_mesh,
    constrain,
    pspec,
)
from autotuner.decompose.allgather import _AG, Ring
from autotuner.decompose.baseline import comm_out_spec
from autotuner.decompose.canonical import canonical, local_shape
from autotuner.decompose.xla import plain_einsum
from autotuner.problem import GroupedProblem, Problem
from autotuner.strategy import Strategy

LocalFn = Callable[..., tuple[jax.Array, ...]]


def wrap(gp: GroupedProblem, mesh: Mesh, local_fn: LocalFn) -> Callable[..., tuple[jax.Array, ...]]:
    """A jittable function of the global arrays `(x, *weights)` running `local_fn` per device."""
    return _wrap(gp.members, mesh, local_fn)


def _wrap(members: Sequence[Problem], mesh: Mesh, local_fn: LocalFn, extra_outs: Sequence[Any] = ()
          ) -> Callable[..., tuple[jax.Array, ...]]:
    """`wrap` over the members of one all-gather (a group, or one problem), whose `local_fn`
    returns each member's result and then one array per `extra_outs` spec."""
    m0 = members[0]
    check_mesh(m0, mesh)
    xs = pspec((m0.lhs if m0.pattern.operand == "lhs" else m0.rhs).spec)
    ws = [pspec((m.rhs if m.pattern.operand == "lhs" else m.lhs).spec) for m in members]
    outs = (*[pspec(m.out_spec) for m in members], *map(pspec, extra_outs))
    mapped = jax.shard_map(local_fn, mesh=mesh, in_specs=(xs, *ws), out_specs=outs, check_vma=False)
    dtype = jnp.dtype(m0.dtype)
    k = len(members)

    def fn(x: jax.Array, *weights: jax.Array) -> tuple[jax.Array, ...]:
        if len(weights) != k:
            raise TypeError(f"the grouped problem has {k} einsums, got {len(weights)} weights")
        x = constrain(jnp.asarray(x, dtype), mesh, xs)
        w = [constrain(jnp.asarray(a, dtype), mesh, s) for a, s in zip(weights, ws, strict=True)]
        return tuple(mapped(x, *w))

    return fn


def _einsum(lay: Layout, x_is_lhs: bool, x: jax.Array, w: jax.Array) -> jax.Array:
    return lay.einsum(x, w) if x_is_lhs else lay.einsum(w, x)


def local_baseline(gp: GroupedProblem) -> LocalFn:
    """The plain all-gather, once, then the k einsums."""
    pat = gp.pattern
    lays = [(Layout(m, pat.axis, gp.axis_size), m.pattern.operand == "lhs") for m in gp.members]

    def fn(x: jax.Array, *ws: jax.Array) -> tuple[jax.Array, ...]:
        full = lax.all_gather(x, pat.axis, axis=pat.dim, tiled=True)
        return tuple(_einsum(lay, is_lhs, full, w) for (lay, is_lhs), w in zip(lays, ws, strict=True))

    return fn


def wrap_comm(gp: GroupedProblem, mesh: Mesh) -> Callable[..., jax.Array]:
    """The one all-gather alone (the harness's T_comm), a function of the same arrays as `build`'s;
    its result is the gathered operand, laid out without the collective axis."""
    pat = gp.pattern
    check_mesh(gp.members[0], mesh)
    xs = pspec(gp.gathered.spec)
    ws = [pspec(w.spec) for w in gp.weights()]
    gathered = pspec(compute_specs(gp)[0])

    def local(x: jax.Array, *_ws: jax.Array) -> jax.Array:
        return lax.all_gather(x, pat.axis, axis=pat.dim, tiled=True)

    return jax.shard_map(local, mesh=mesh, in_specs=(xs, *ws), out_specs=gathered, check_vma=False)


def compute_only(gp: GroupedProblem, mesh: Mesh) -> Callable[..., tuple[jax.Array, ...]]:
    """The k einsums alone on the whole gathered operand (its input spec loses the collective
    axis), for the harness's T_comp."""
    pat = gp.pattern
    check_mesh(gp.members[0], mesh)
    lays = [(Layout(m, pat.axis, gp.axis_size), m.pattern.operand == "lhs") for m in gp.members]

    def fn(x: jax.Array, *ws: jax.Array) -> tuple[jax.Array, ...]:
        return tuple(_einsum(lay, is_lhs, x, w) for (lay, is_lhs), w in zip(lays, ws, strict=True))

    return jax.shard_map(fn, mesh=mesh, in_specs=tuple(map(pspec, compute_specs(gp))),
                         out_specs=tuple(pspec(m.out_spec) for m in gp.members), check_vma=False)


def compute_specs(gp: GroupedProblem) -> list[Sequence[Any]]:
    """The input specs of `compute_only`: the gathered operand whole, the weights as they are."""
    return [comm_out_spec(gp.members[0]), *[w.spec for w in gp.weights()]]


class _Keep(_AG):
    """A ring member that multiplies by nothing: each block of the shared operand is written into
    the gathered buffer as it passes, so the ring also yields what the all-gather would (`keep`)."""

    def __init__(self, problem: Problem, s: Strategy):
        super().__init__(problem, s)
        self.acc, self.odim = False, self.xdim

    def partial(self, xc: jax.Array, y: jax.Array, b: Any, k: int, sub: int = 0) -> jax.Array:
        return xc

    def init_out(self, x: jax.Array, y: jax.Array) -> jax.Array:
        shape = list(x.shape)
        shape[self.xdim] = self.blk * self.n
        return jnp.zeros(shape, x.dtype)


def local_ring(gp: GroupedProblem, s: Strategy) -> LocalFn:
    g = Ring([_AG(m, s) for m in gp.members], s)
    return g.bidi if s.direction == "bidi" else g.uni


def wrap_keeping(members: Sequence[Problem], s: Strategy, mesh: Mesh) -> Callable[..., tuple[jax.Array, ...]]:
    """The ring of `s` (valid for every member: `decompose.build_keeping` checks) over the one
    all-gather of `members`, that also returns the gathered operand: `fn(x, *weights) ->
    (*results, gathered)`, x the gathered operand whichever side of the einsums it stands on,
    `gathered` laid out without the collective axis (`comm_out_spec`)."""
    m0 = members[0]
    cp = canonical(m0) if len(members) == 1 else None
    ms = [cp] if cp is not None else list(members)
    g = Ring([*(_AG(m, s) for m in ms), _Keep(ms[0], s)], s)
    ring = g.bidi if s.direction == "bidi" else g.uni
    if cp is None:
        return _wrap(members, mesh, lambda x, *w: ring(x, *w, x), [comm_out_spec(m0)])
    # one problem: the ring runs on its canonical matmul, as `build` runs it (canonical.py);
    # operands reshaped in, result and gathered operand reshaped out (bitcasts)
    xs, ws = ("lhs", "rhs") if m0.pattern.operand == "lhs" else ("rhs", "lhs")
    x_c, w_c, out = local_shape(cp, xs), local_shape(cp, ws), local_shape(m0, "out")
    mesh_shape = m0.mesh_shape
    full = (m0.lhs if xs == "lhs" else m0.rhs).shape
    kept = tuple(d // math.prod(mesh_shape[a] for a in e) for d, e in zip(full, comm_out_spec(m0), strict=True))

    def local(x: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
        xc = x.reshape(x_c)
        res, gathered = ring(xc, w.reshape(w_c), xc)
        return res.reshape(out), gathered.reshape(kept)

    return _wrap(members, mesh, local, [comm_out_spec(m0)])


def plain_einsums(gp: GroupedProblem, mesh: Mesh) -> Callable[..., tuple[jax.Array, ...]]:
    """The k einsums under GSPMD (the partitioner inserts the gather); for `xla_windowed`."""
    fns = [(plain_einsum(m, mesh), m.pattern.operand == "lhs") for m in gp.members]

    def fn(x: jax.Array, *weights: jax.Array) -> tuple[jax.Array, ...]:
        return tuple(f(x, w) if is_lhs else f(w, x) for (f, is_lhs), w in zip(fns, weights, strict=True))

    return fn

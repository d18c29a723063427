"""The baseline: the plain collective and the plain einsum, as GSPMD would emit them.

Also the two halves of it alone (collective only, einsum only), which the harness times to get
the bound max(T_comm, T_comp) that a perfect overlap would reach.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax import lax
from jax.sharding import Mesh

from autotuner.decompose._common import Layout, check_mesh, pspec
from autotuner.problem import Entry, Problem


def local_baseline(problem: Problem) -> Callable[[jax.Array, jax.Array], jax.Array]:
    p, pat = problem, problem.pattern
    lay = Layout(p, pat.axis or "", problem.axis_size)

    if pat.kind == "none":
        return lambda lhs, rhs: lay.einsum(lhs, rhs)

    if pat.kind == "all_gather":
        letters = p.eq.lhs if pat.operand == "lhs" else p.eq.rhs
        dim = letters.index(pat.letter)

        def ag(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
            if pat.operand == "lhs":
                lhs = lax.all_gather(lhs, pat.axis, axis=dim, tiled=True)
            else:
                rhs = lax.all_gather(rhs, pat.axis, axis=dim, tiled=True)
            return lay.einsum(lhs, rhs)

        return ag

    dim = p.eq.out.index(pat.letter)

    def rs(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        return lax.psum_scatter(lay.einsum(lhs, rhs), pat.axis, scatter_dimension=dim, tiled=True)

    return rs


def local_comm_only(problem: Problem) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """The collective alone, on data of the size the baseline moves (result discarded by caller)."""
    p, pat = problem, problem.pattern
    if pat.kind == "all_gather":
        letters = p.eq.lhs if pat.operand == "lhs" else p.eq.rhs
        dim = letters.index(pat.letter)
        return lambda lhs, rhs: lax.all_gather(lhs if pat.operand == "lhs" else rhs, pat.axis,
                                               axis=dim, tiled=True)
    if pat.kind == "reduce_scatter":
        lay = Layout(p, pat.axis, p.axis_size)
        dim = p.eq.out.index(pat.letter)
        shape = _local_out_shape(p, gathered=True)

        def rs(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
            # A buffer of the einsum's local result shape, built without doing the einsum.
            full = lax.broadcast_in_dim(lhs.reshape(-1)[0] + rhs.reshape(-1)[0], shape, ())
            return lax.psum_scatter(full.astype(lay.dtype), pat.axis, scatter_dimension=dim, tiled=True)

        return rs
    return lambda lhs, rhs: lhs


def gathered_specs(problem: Problem) -> tuple[list[Entry], list[Entry]]:
    """(lhs spec, rhs spec) after the baseline's all-gather: the collective axis dropped from the
    gathered letter of the gathered operand (unchanged for a reduce-scatter)."""
    p, pat = problem, problem.pattern
    ls, rs = list(p.lhs.spec), list(p.rhs.spec)
    if pat.kind == "all_gather":
        spec, letters = (ls, p.eq.lhs) if pat.operand == "lhs" else (rs, p.eq.rhs)
        i = letters.index(pat.letter)
        spec[i] = tuple(spec[i][:-1])
    return ls, rs


def comm_out_spec(problem: Problem) -> tuple[Entry, ...]:
    """The spec of what `local_comm_only` returns: the gathered operand (so its rank is the
    operand's, not the einsum output's), or the scattered result."""
    pat = problem.pattern
    if pat.kind != "all_gather":
        return tuple(problem.out_spec)
    return tuple(gathered_specs(problem)[0 if pat.operand == "lhs" else 1])


def compute_only(problem: Problem, mesh: Mesh) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """The einsum alone, on the operand sizes the baseline multiplies: the gathered operand whole
    (its input spec loses the collective axis), or the un-scattered partial result."""
    p, pat = problem, problem.pattern
    lay = Layout(p, pat.axis or "", p.axis_size)
    ls, rs = gathered_specs(p)
    # reduce-scatter: out_spec kept, so each device's block is its whole unreduced partial
    # result (the global array is axis_size times larger along the scattered letter).
    check_mesh(p, mesh)
    return jax.shard_map(lambda a, b: lay.einsum(a, b), mesh=mesh,
                         in_specs=(pspec(ls), pspec(rs)), out_specs=pspec(p.out_spec), check_vma=False)


def _local_out_shape(p: Problem, *, gathered: bool) -> tuple[int, ...]:
    pat, mesh = p.pattern, p.mesh_shape
    shape = []
    for c, d, e in zip(p.eq.out, p.out_shape, p.out_spec, strict=True):
        parts = 1
        for a in e:
            parts *= mesh[a]
        size = d // parts
        if gathered and c == pat.letter:
            size *= p.axis_size
        shape.append(size)
    return tuple(shape)

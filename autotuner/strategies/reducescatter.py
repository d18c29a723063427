"""einsum -> ReduceScatter, decomposed into a ring of partial results that accumulate.

Every device holds a slice of the sharded contracting letter, so its einsum is a partial sum of
the whole output. Device i must end with output block i (along the scattered letter L) summed
over all devices. An accumulator for block b travels the ring; each device it passes adds its
own partial einsum of block b, which it computes while the accumulator is in flight.

Unidirectional: the accumulator for block i starts on device i+1 and travels right.
Bidirectional: two accumulators per block, one from each side (ceil((n-1)/2) steps); for even n
the antipodal device's contribution is split in halves, one per direction, sent first.
Partial einsums of bfloat16/float16 are accumulated in float32 and cast back to the dtype for
the wire, as the plain reduce-scatter of the baseline carries it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from autotuner.problem import Problem
from autotuner.strategies._common import Layout, run_loop, slice_dim
from autotuner.strategy import Strategy


class _RS:
    def __init__(self, problem: Problem, s: Strategy):
        pat = problem.pattern
        self.p, self.s, self.L = problem, s, pat.letter
        self.lay = Layout(problem, pat.axis, problem.axis_size)
        self.n = self.lay.n
        self.odim = problem.eq.out.index(self.L)
        self.blk = self.lay.local_extent("out", self.L)
        self.cs = self.blk // s.chunks

    def partial(self, lhs: jax.Array, rhs: jax.Array, i: Any, off: Any, k: int,
                sub: int = 0, size: int | None = None) -> jax.Array:
        """This device's partial einsum of output block i+off, chunk k (from `sub`, `size` long)."""
        size = self.cs if size is None else size
        start = ((i + off) % self.n) * self.blk + k * self.cs + sub
        eq = self.p.eq
        a = slice_dim(lhs, eq.lhs, self.L, start, size)
        b = slice_dim(rhs, eq.rhs, self.L, start, size)
        return self.lay.einsum(a, b, f32=self.lay.low_precision)

    def add(self, recv: jax.Array, part: jax.Array) -> jax.Array:
        """Received accumulator + own partial, in float32 for low precision, back to the dtype."""
        return (recv.astype(part.dtype) + part).astype(self.lay.dtype)

    def hop(self, accs: list[jax.Array], parts_fn: Callable[[], list[jax.Array]],
            perm: list[tuple[int, int]]) -> list[jax.Array]:
        """Send the accumulators one hop and add this device's partials, in the strategy's order."""
        if self.s.send_first:
            recv = self.lay.send(accs, perm)
            parts = parts_fn()
        else:
            parts = parts_fn()
            recv = self.lay.send(accs, perm)
        return [self.add(r, q) for r, q in zip(recv, parts, strict=True)]

    def uni(self, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        n, s, lay = self.n, self.s, self.lay
        i = lax.axis_index(lay.axis)
        accs = [self.partial(lhs, rhs, i, -1, k).astype(lay.dtype) for k in range(s.chunks)]

        def body(accs, t):
            parts = lambda: [self.partial(lhs, rhs, i, -1 - t, k) for k in range(s.chunks)]  # noqa: E731
            return self.hop(accs, parts, lay.right()), None

        accs, _ = run_loop(body, accs, 1, n, s.unroll)
        return jnp.concatenate(accs, axis=self.odim) if s.chunks > 1 else accs[0]

    def bidi(self, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        n, s, lay = self.n, self.s, self.lay
        h, even = (n - 1) // 2, n % 2 == 0
        half = self.cs // 2
        i = lax.axis_index(lay.axis)
        ks = range(s.chunks)

        def right_parts(t: Any) -> list[jax.Array]:
            """Partials for the right-moving chain at step t: block i+h-t+1."""
            return [self.partial(lhs, rhs, i, h - t + 1, k) for k in ks]

        def left_parts(t: Any) -> list[jax.Array]:
            """Partials for the left-moving chain at step t: block i-h+t-1."""
            return [self.partial(lhs, rhs, i, -(h - t + 1), k) for k in ks]

        if even:
            # step 0: the antipodal block's halves, the first to the right, the second to the left
            pa = [self.partial(lhs, rhs, i, n // 2, k, 0, half).astype(lay.dtype) for k in ks]
            pb = [self.partial(lhs, rhs, i, n // 2, k, half, half).astype(lay.dtype) for k in ks]
            if s.send_first:
                ra, lb = lay.send(pa, lay.right()), lay.send(pb, lay.left())
                pr, pl = right_parts(1), left_parts(1)
            else:
                pr, pl = right_parts(1), left_parts(1)
                ra, lb = lay.send(pa, lay.right()), lay.send(pb, lay.left())
            r = [jnp.concatenate([self.add(a, lax.slice_in_dim(q, 0, half, axis=self.odim)),
                                  lax.slice_in_dim(q, half, self.cs, axis=self.odim).astype(lay.dtype)],
                                 axis=self.odim) for a, q in zip(ra, pr, strict=True)]
            lft = [jnp.concatenate([lax.slice_in_dim(q, 0, half, axis=self.odim).astype(lay.dtype),
                                    self.add(b, lax.slice_in_dim(q, half, self.cs, axis=self.odim))],
                                   axis=self.odim) for b, q in zip(lb, pl, strict=True)]
        else:
            pr, pl = right_parts(1), left_parts(1)
            r = [q.astype(lay.dtype) for q in pr]
            lft = [q.astype(lay.dtype) for q in pl]

        def body(carry, t):
            r, lft = carry
            r = self.hop(r, lambda: right_parts(t), lay.right())
            lft = self.hop(lft, lambda: left_parts(t), lay.left())
            return (r, lft), None

        (r, lft), _ = run_loop(body, (r, lft), 2, h + 1, s.unroll)
        # last hop: both accumulators arrive at their owner, who adds its own block
        if s.send_first:
            rr, rl = lay.send(r, lay.right()), lay.send(lft, lay.left())
            own = [self.partial(lhs, rhs, i, 0, k) for k in ks]
        else:
            own = [self.partial(lhs, rhs, i, 0, k) for k in ks]
            rr, rl = lay.send(r, lay.right()), lay.send(lft, lay.left())
        outs = [(a.astype(q.dtype) + b.astype(q.dtype) + q).astype(lay.dtype)
                for a, b, q in zip(rr, rl, own, strict=True)]
        return jnp.concatenate(outs, axis=self.odim) if s.chunks > 1 else outs[0]


def local_ring(problem: Problem, s: Strategy) -> Callable[[jax.Array, jax.Array], jax.Array]:
    rs = _RS(problem, s)
    return rs.bidi if s.direction == "bidi" else rs.uni

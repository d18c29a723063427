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

The partial einsums run one after the other, each reading one element of the result before it
(`after`): a transfer can start only once its accumulator is computed, and the partials of later
steps, which nothing else orders, would otherwise start at once and share the cores with the one
whose result must be sent first. XLA:CPU runs independent thunks concurrently, so without this
chain every send waited for most of the compute (measured on the lab, shared:2, `sf,fd->sd` of
the suite's attn_out: the best ring 60.8 ms against 43.1 ms with the chain, baseline 57-71 ms).
An optimization barrier would not do: XLA removes it before scheduling.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from autotuner.decompose._common import (
    Blocks,
    Layout,
    after,
    block_start,
    held,
    run_loop,
    slice_dim,
)
from autotuner.problem import Problem
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

    def partial(self, lhs: jax.Array, rhs: jax.Array, at: Blocks, off: Any, k: int,
                sub: int = 0, size: int | None = None, dep: Any = None) -> jax.Array:
        """This device's partial einsum of output block i+off (`at(off)`), chunk k (from `sub`,
        `size` long), started once `dep` is computed."""
        size = self.cs if size is None else size
        start = block_start(at(off), self.blk, k * self.cs + sub)
        wait = after(dep)
        if not isinstance(wait, int):
            start = start + wait
        eq = self.p.eq
        a = slice_dim(lhs, eq.lhs, self.L, start, size)
        b = slice_dim(rhs, eq.rhs, self.L, start, size)
        return self.lay.einsum(a, b, f32=self.lay.low_precision)

    def add(self, recv: jax.Array, part: jax.Array) -> jax.Array:
        """Received accumulator + own partial, in float32 for low precision, back to the dtype."""
        return (recv.astype(part.dtype) + part).astype(self.lay.dtype)

    def chain(self, fn: Callable[[int, Any], jax.Array], dep: Any) -> list[jax.Array]:
        """[fn(k, d) for each chunk k], d the result before (for the first: `dep`)."""
        out: list[jax.Array] = []
        for k in range(self.s.chunks):
            out.append(fn(k, out[-1] if out else dep))
        return out

    def hop(self, accs: list[list[jax.Array]], parts_fn: Callable[[Any], list[list[jax.Array]]],
            perms: list[list[tuple[int, int]]]) -> list[list[jax.Array]]:
        """Send each list of accumulators one hop along its permutation and add this device's
        partials (which start after the accumulators are computed, and `parts_fn`'s argument), in
        the strategy's order; the serial control holds the second of the two until the first is done."""
        serial = self.s.is_control
        send = lambda accs: [self.lay.send(a, p) for a, p in zip(accs, perms, strict=True)]  # noqa: E731
        if self.s.send_first:   # the control sends once every accumulator is computed
            recv = send([held(a, accs) for a in accs] if serial else accs)
            parts = parts_fn(recv if serial else None)
        else:
            parts = parts_fn(None)
            recv = send([held(a, (accs, parts)) for a in accs] if serial else accs)
        return [[self.add(r, q) for r, q in zip(rs, qs, strict=True)] for rs, qs in zip(recv, parts, strict=True)]

    def uni(self, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        n, s, lay = self.n, self.s, self.lay
        at = Blocks(lax.axis_index(lay.axis), n)
        accs = self.chain(lambda k, d: self.partial(lhs, rhs, at, -1, k, dep=d).astype(lay.dtype), None)

        def body(accs, t):
            parts = lambda w: [self.chain(lambda k, d: self.partial(lhs, rhs, at, -1 - t, k, dep=d), (accs, w))]  # noqa: E731
            return self.hop([accs], parts, [lay.right()])[0], None

        accs, _ = run_loop(body, accs, 1, n, s.unroll)
        return jnp.concatenate(accs, axis=self.odim) if s.chunks > 1 else accs[0]

    def bidi(self, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        n, s, lay = self.n, self.s, self.lay
        h, even = (n - 1) // 2, n % 2 == 0
        half = self.cs // 2
        at = Blocks(lax.axis_index(lay.axis), n)

        def both_parts(t: Any, dep: Any) -> list[list[jax.Array]]:
            """Partials at step t, after `dep`: for the right-moving accumulators block i+h-t+1,
            then for the left-moving ones block i-h+t-1."""
            right = self.chain(lambda k, d: self.partial(lhs, rhs, at, h - t + 1, k, dep=d), dep)
            return [right, self.chain(lambda k, d: self.partial(lhs, rhs, at, -(h - t + 1), k, dep=d), right)]

        if even:
            # step 0: the antipodal block's halves, the first to the right, the second to the left
            pa = self.chain(lambda k, d: self.partial(lhs, rhs, at, n // 2, k, 0, half, d).astype(lay.dtype), None)
            pb = self.chain(lambda k, d: self.partial(lhs, rhs, at, n // 2, k, half, half, d).astype(lay.dtype), pa)
            if s.send_first:
                if s.is_control:   # the first half is sent once the second is computed too
                    pa = held(pa, pb)
                ra, lb = lay.send(pa, lay.right()), lay.send(pb, lay.left())
                pr, pl = both_parts(1, (pb, ra, lb) if s.is_control else pb)
            else:
                pr, pl = both_parts(1, pb)
                if s.is_control:
                    pa, pb = held(pa, (pr, pl)), held(pb, (pr, pl))
                ra, lb = lay.send(pa, lay.right()), lay.send(pb, lay.left())
            r = [jnp.concatenate([self.add(a, lax.slice_in_dim(q, 0, half, axis=self.odim)),
                                  lax.slice_in_dim(q, half, self.cs, axis=self.odim).astype(lay.dtype)],
                                 axis=self.odim) for a, q in zip(ra, pr, strict=True)]
            lft = [jnp.concatenate([lax.slice_in_dim(q, 0, half, axis=self.odim).astype(lay.dtype),
                                    self.add(b, lax.slice_in_dim(q, half, self.cs, axis=self.odim))],
                                   axis=self.odim) for b, q in zip(lb, pl, strict=True)]
            if s.is_control:   # their first elements need not wait for both halves: the whole does
                r, lft = held(r, (ra, lb)), held(lft, (ra, lb))
        else:
            pr, pl = both_parts(1, None)
            r = [q.astype(lay.dtype) for q in pr]
            lft = [q.astype(lay.dtype) for q in pl]

        def body(carry, t):
            r, lft = carry
            r, lft = self.hop([r, lft], lambda w: both_parts(t, (r, lft, w)), [lay.right(), lay.left()])
            return (r, lft), None

        (r, lft), _ = run_loop(body, (r, lft), 2, h + 1, s.unroll)
        # last hop: both accumulators arrive at their owner, who adds its own block
        own_parts = lambda w: self.chain(lambda k, d: self.partial(lhs, rhs, at, 0, k, dep=d), (r, lft, w))  # noqa: E731
        if s.send_first:
            if s.is_control:
                r, lft = held(r, (r, lft)), held(lft, (r, lft))
            rr, rl = lay.send(r, lay.right()), lay.send(lft, lay.left())
            own = own_parts((rr, rl) if s.is_control else None)
        else:
            own = own_parts(None)
            if s.is_control:
                r, lft = held(r, own), held(lft, own)
            rr, rl = lay.send(r, lay.right()), lay.send(lft, lay.left())
        outs = [(a.astype(q.dtype) + b.astype(q.dtype) + q).astype(lay.dtype)
                for a, b, q in zip(rr, rl, own, strict=True)]
        return jnp.concatenate(outs, axis=self.odim) if s.chunks > 1 else outs[0]


def local_ring(problem: Problem, s: Strategy) -> Callable[[jax.Array, jax.Array], jax.Array]:
    rs = _RS(problem, s)
    return rs.bidi if s.direction == "bidi" else rs.uni

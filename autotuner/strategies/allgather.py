"""AllGather -> einsum, decomposed into a ring of CollectivePermutes and partial einsums.

Device i (of n along the collective axis) starts with block i of the gathered operand X along
the gathered letter L. While it multiplies the block it holds, that block is already travelling
to the next device, so transfer and einsum overlap. What a partial einsum of block b yields
depends on the class of L:
- free (L only in X and the output): the output's slot b along L;
- batch (L in X, the other operand Y and the output): slot b, with Y sliced to block b;
- contracting (L in X and Y only): a partial sum over block b, with Y sliced to block b.

Offsets below are block offsets relative to the device: block (i + off) mod n.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from autotuner.problem import Problem
from autotuner.strategies._common import Blocks, Layout, block_start, run_loop, slice_dim, split
from autotuner.strategy import Strategy


class _AG:
    def __init__(self, problem: Problem, s: Strategy):
        pat = problem.pattern
        self.p, self.s, self.L = problem, s, pat.letter
        self.lay = Layout(problem, pat.axis, problem.axis_size)
        self.n = self.lay.n
        self.x_is_lhs = pat.operand == "lhs"
        eq = problem.eq
        self.xl, self.yl = (eq.lhs, eq.rhs) if self.x_is_lhs else (eq.rhs, eq.lhs)
        self.xdim = self.xl.index(self.L)
        self.blk = self.lay.local_extent(pat.operand, self.L)
        self.cs = self.blk // s.chunks
        self.acc = pat.dim_class == "contracting"
        self.odim = None if self.acc else eq.out.index(self.L)

    # -- pieces ---------------------------------------------------------------------------------
    def partial(self, xc: jax.Array, y: jax.Array, b: Any, k: int, sub: int = 0) -> jax.Array:
        """Partial einsum of X piece `xc` = chunk k (from element `sub` of it) of block `b`
        (traced: `Blocks`)."""
        size = xc.shape[self.xdim]
        yp = slice_dim(y, self.yl, self.L, self.start(b, k, sub), size)
        lhs, rhs = (xc, yp) if self.x_is_lhs else (yp, xc)
        return self.lay.einsum(lhs, rhs, f32=self.acc and self.lay.low_precision)

    def start(self, b: Any, k: int, sub: int = 0) -> Any:
        return block_start(b, self.blk, k * self.cs + sub)

    def absorb(self, out: jax.Array, parts: list[jax.Array], b: Any) -> jax.Array:
        """fuse='loop': write (or add) the step's chunk results for block `b` into the output carry."""
        for k, part in enumerate(parts):
            if self.acc:
                out = out + part
            else:
                out = lax.dynamic_update_slice_in_dim(out, part, self.start(b, k), self.odim,
                                                      allow_negative_indices=False)
        return out

    def step(self, bufs: list[jax.Array], y: jax.Array, b: Any,
             send: Callable[[list[jax.Array]], list[jax.Array]] | None):
        """One ring step, of block `b`: the transfer of `bufs` (if any) and their partial einsums,
        in the order the strategy asks for. Returns (received buffers, partial results)."""
        nxt = send(bufs) if send is not None and self.s.send_first else None
        parts = [self.partial(buf, y, b, k) for k, buf in enumerate(bufs)]
        if send is not None and not self.s.send_first:
            nxt = send(bufs)
        return nxt, parts

    def assemble(self, by_offset: list[jax.Array], i: Any, out_dtype: Any) -> jax.Array:
        """fuse='after': `by_offset` stacks the chunk results as [offset 0..n-1, chunk, ...]."""
        stacked = jnp.concatenate(by_offset, axis=0)
        if self.acc:
            total = jnp.sum(stacked.reshape((-1,) + stacked.shape[2:]), axis=0)
            return total.astype(out_dtype)
        blocks = jnp.roll(stacked, i, axis=0) if self.n > 1 else stacked  # [block b] = offset b - i
        # [n, c, ..., cs at odim, ...] -> merge (n, c, cs) into the output's L dimension
        moved = jnp.moveaxis(blocks, (0, 1), (self.odim, self.odim + 1))
        shape = list(moved.shape)
        merged = shape[: self.odim] + [shape[self.odim] * shape[self.odim + 1] * shape[self.odim + 2]] \
            + shape[self.odim + 3:]
        return moved.reshape(merged)

    def init_out(self, x: jax.Array, y: jax.Array) -> jax.Array:
        """A zero output carry of the local output's shape (or the f32 accumulator)."""
        sizes = dict(zip(self.yl, y.shape, strict=True))
        sizes.update(zip(self.xl, x.shape, strict=True))
        sizes[self.L] = self.cs
        dtype = jnp.float32 if self.acc and self.lay.low_precision else self.lay.dtype
        shape = [sizes[c] for c in self.p.eq.out]
        if not self.acc:
            shape[self.odim] = self.blk * self.n
        return jnp.zeros(shape, dtype)

    # -- programs -------------------------------------------------------------------------------
    def uni(self, x: jax.Array, y: jax.Array) -> jax.Array:
        n, s, lay = self.n, self.s, self.lay
        i = lax.axis_index(lay.axis)
        at = Blocks(i, n)
        bufs = split(x, s.chunks, self.xdim)
        send = lambda b: lay.send(b, lay.left())  # noqa: E731 - device j receives block j+1+t
        loop = s.fuse == "loop"
        out0 = self.init_out(x, y) if loop else None

        def body(carry, t):
            bufs, out = carry
            nxt, parts = self.step(bufs, y, at(t), send)
            if loop:
                return (nxt, self.absorb(out, parts, at(t))), None
            return (nxt, out), jnp.stack(parts)

        (bufs, out), ys = run_loop(body, (bufs, out0), 0, n - 1, s.unroll)
        _, parts = self.step(bufs, y, at(n - 1), None)
        if loop:
            return self.absorb(out, parts, at(n - 1)).astype(lay.dtype)
        return self.assemble(ys + [jnp.stack(parts)[None]], i, lay.dtype)

    def bidi(self, x: jax.Array, y: jax.Array) -> jax.Array:
        n, s, lay = self.n, self.s, self.lay
        h, even = (n - 1) // 2, n % 2 == 0
        i = lax.axis_index(lay.axis)
        at = Blocks(i, n)
        local = split(x, s.chunks, self.xdim)
        loop = s.fuse == "loop"

        def both(r, lb, t, send: bool):
            """Right-moving buffers hold block i-t, left-moving ones block i+t."""
            sr = (lambda b: lay.send(b, lay.right())) if send else None
            sl = (lambda b: lay.send(b, lay.left())) if send else None
            nr, pr = self.step(r, y, at(-t), sr)
            nl, pl = self.step(lb, y, at(t), sl)
            return nr, nl, pr, pl

        # step 0: the local block, sent both ways
        send_both = lambda b: lay.send(b, lay.right()) + lay.send(b, lay.left())  # noqa: E731
        sent, pl0 = self.step(local, y, at(0), send_both)
        nr, nl = sent[: s.chunks], sent[s.chunks:]
        out = self.absorb(self.init_out(x, y), pl0, at(0)) if loop else None

        def body(carry, t):
            r, lb, out = carry
            r2, l2, pr, pl = both(r, lb, t, True)
            if loop:
                return (r2, l2, self.absorb(self.absorb(out, pr, at(-t)), pl, at(t))), None
            return (r2, l2, out), (jnp.stack(pr), jnp.stack(pl))

        (r, lb, out), ys = run_loop(body, (nr, nl, out), 1, h, s.unroll)
        # last full step t = h; for even n the antipodal block comes in halves from both sides
        half = self.cs // 2
        if even:
            ra = lay.send([lax.slice_in_dim(b, 0, half, axis=self.xdim) for b in r], lay.right()) \
                if s.send_first else None
            lb_b = lay.send([lax.slice_in_dim(b, half, self.cs, axis=self.xdim) for b in lb], lay.left()) \
                if s.send_first else None
        _, _, pr, pl = both(r, lb, h, False)
        parts_anti: list[jax.Array] = []
        if even:
            if not s.send_first:
                ra = lay.send([lax.slice_in_dim(b, 0, half, axis=self.xdim) for b in r], lay.right())
                lb_b = lay.send([lax.slice_in_dim(b, half, self.cs, axis=self.xdim) for b in lb], lay.left())
            for k in range(s.chunks):
                pa = self.partial(ra[k], y, at(n // 2), k, 0)
                pb = self.partial(lb_b[k], y, at(n // 2), k, half)
                parts_anti.append(pa + pb if self.acc else jnp.concatenate([pa, pb], axis=self.odim))
        if loop:
            out = self.absorb(self.absorb(out, pr, at(-h)), pl, at(h))
            if even:
                out = self.absorb(out, parts_anti, at(n // 2))
            return out.astype(lay.dtype)
        loop_r = [ys[0][0]] if ys else []
        loop_l = [ys[0][1]] if ys else []
        if s.unroll == "full":
            loop_r = [y_[0] for y_ in ys]
            loop_l = [y_[1] for y_ in ys]
        # offsets 0, 1..h (left), n/2 (even), then n-h..n-1 (right, t = h..1)
        rights = loop_r + [jnp.stack(pr)[None]]          # t = 1..h
        right_stack = jnp.concatenate(rights, axis=0)[::-1]  # t = h..1 -> offsets n-h..n-1
        by_off = [jnp.stack(pl0)[None]] + loop_l + [jnp.stack(pl)[None]]
        if even:
            by_off.append(jnp.stack(parts_anti)[None])
        by_off.append(right_stack)
        return self.assemble(by_off, i, lay.dtype)


def local_ring(problem: Problem, s: Strategy) -> Callable[[jax.Array, jax.Array], jax.Array]:
    ag = _AG(problem, s)
    fn = ag.bidi if s.direction == "bidi" else ag.uni
    if ag.x_is_lhs:
        return fn
    return lambda lhs, rhs: fn(rhs, lhs)

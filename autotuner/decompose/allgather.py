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

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from autotuner.decompose._common import (
    Blocks,
    Layout,
    block_start,
    held,
    run_loop,
    slice_dim,
    split,
)
from autotuner.problem import Problem
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


class Ring:
    """The ring loop of one gathered operand X, driving the partial einsums of every member's
    pieces (`_AG`, or `grouped._Keep`, which collects X itself): a single problem's ring is a ring
    of one member (`local_ring`), a GroupedProblem's has one per einsum (`grouped.local_ring`).
    `uni`/`bidi` take X and one other operand per member and return one result per member."""

    def __init__(self, ags: Sequence[_AG], s: Strategy):
        self.s = s
        self.ags = list(ags)
        a0 = self.ags[0]
        self.n, self.lay, self.xdim, self.cs = a0.n, a0.lay, a0.xdim, a0.cs

    def step(self, bufs: list[jax.Array], ws: Sequence[jax.Array], b: Any,
             send: Callable[[list[jax.Array]], list[jax.Array]] | None,
             where: Sequence[tuple[Any, int]] | None = None):
        """One ring step, of block `b`: the shared buffers' transfer and every member's partial
        einsums of them (buffer j is chunk j of block `b`, or `where[j]`: (block, chunk))."""
        at = list(where) if where is not None else [(b, k) for k in range(len(bufs))]

        def compute(bufs: list[jax.Array]) -> list[list[jax.Array]]:
            return [[ag.partial(buf, w, bb, k) for buf, (bb, k) in zip(bufs, at, strict=True)]
                    for ag, w in zip(self.ags, ws, strict=True)]

        serial = self.s.is_control and send is not None
        if send is None:
            return None, compute(bufs)
        if self.s.send_first:
            nxt = send(bufs)
            parts = compute(held(bufs, nxt) if serial else bufs)   # control: the transfer first
        else:
            parts = compute(bufs)
            nxt = send(held(bufs, parts) if serial else bufs)      # control: the einsum first
        if serial:   # and whatever comes next (the next transfers, einsums) after all of this step's
            nxt = held(nxt, (nxt, parts))
        return nxt, parts

    def absorb(self, outs: Sequence[jax.Array], parts: list[list[jax.Array]], b: Any) -> tuple:
        return tuple(ag.absorb(o, p, b) for ag, o, p in zip(self.ags, outs, parts, strict=True))

    def init_outs(self, x: jax.Array, ws: Sequence[jax.Array]) -> tuple:
        return tuple(ag.init_out(x, w) for ag, w in zip(self.ags, ws, strict=True))

    def done(self, outs: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
        return tuple(o.astype(self.lay.dtype) for o in outs)

    @staticmethod
    def stacked(parts: list[list[jax.Array]]) -> tuple[jax.Array, ...]:
        return tuple(jnp.stack(p) for p in parts)

    # -- programs -------------------------------------------------------------------------------
    def uni(self, x: jax.Array, *ws: jax.Array) -> tuple[jax.Array, ...]:
        n, s, lay = self.n, self.s, self.lay
        i = lax.axis_index(lay.axis)
        at = Blocks(i, n)
        bufs = split(x, s.chunks, self.xdim)
        send = lambda b: lay.send(b, lay.left())  # noqa: E731 - device j receives block j+1+t
        loop = s.fuse == "loop"
        outs0 = self.init_outs(x, ws) if loop else None

        def body(carry, t):
            bufs, outs = carry
            nxt, parts = self.step(bufs, ws, at(t), send)
            if loop:
                return (nxt, self.absorb(outs, parts, at(t))), None
            return (nxt, outs), self.stacked(parts)

        (bufs, outs), ys = run_loop(body, (bufs, outs0), 0, n - 1, s.unroll)
        _, parts = self.step(bufs, ws, at(n - 1), None)
        if loop:
            return self.done(self.absorb(outs, parts, at(n - 1)))
        last = self.stacked(parts)
        return tuple(ag.assemble([y[m] for y in ys] + [last[m][None]], i, lay.dtype)
                     for m, ag in enumerate(self.ags))

    def bidi(self, x: jax.Array, *ws: jax.Array) -> tuple[jax.Array, ...]:
        n, s, lay, k = self.n, self.s, self.lay, len(self.ags)
        h, even = (n - 1) // 2, n % 2 == 0
        i = lax.axis_index(lay.axis)
        at = Blocks(i, n)
        local = split(x, s.chunks, self.xdim)
        loop = s.fuse == "loop"

        def both(r, lb, t, send: bool):
            """Right-moving buffers hold block i-t, left-moving ones block i+t."""
            if send and s.is_control:   # the control: both transfers, then both einsums, as one step
                c = s.chunks
                where = [(at(-t), k) for k in range(c)] + [(at(t), k) for k in range(c)]
                sent, parts = self.step([*r, *lb], ws, None, lambda b: lay.send(b[:c], lay.right())
                                        + lay.send(b[c:], lay.left()), where)
                return sent[:c], sent[c:], [p[:c] for p in parts], [p[c:] for p in parts]
            sr = (lambda b: lay.send(b, lay.right())) if send else None
            sl = (lambda b: lay.send(b, lay.left())) if send else None
            nr, pr = self.step(r, ws, at(-t), sr)
            nl, pl = self.step(lb, ws, at(t), sl)
            return nr, nl, pr, pl

        send_both = lambda b: lay.send(b, lay.right()) + lay.send(b, lay.left())  # noqa: E731
        sent, pl0 = self.step(local, ws, at(0), send_both)
        nr, nl = sent[: s.chunks], sent[s.chunks:]
        outs = self.absorb(self.init_outs(x, ws), pl0, at(0)) if loop else None

        def body(carry, t):
            r, lb, outs = carry
            r2, l2, pr, pl = both(r, lb, t, True)
            if loop:
                return (r2, l2, self.absorb(self.absorb(outs, pr, at(-t)), pl, at(t))), None
            return (r2, l2, outs), (self.stacked(pr), self.stacked(pl))

        (r, lb, outs), ys = run_loop(body, (nr, nl, outs), 1, h, s.unroll)
        half = self.cs // 2
        halves = lambda bs, a, b: [lax.slice_in_dim(x_, a, b, axis=self.xdim) for x_ in bs]  # noqa: E731
        if even and s.send_first:
            ra = lay.send(halves(r, 0, half), lay.right())
            lb_b = lay.send(halves(lb, half, self.cs), lay.left())
            if s.is_control:   # the antipodal halves arrive before the last einsums start
                r, lb = held(r, (ra, lb_b)), held(lb, (ra, lb_b))
        _, _, pr, pl = both(r, lb, h, False)
        anti: list[list[jax.Array]] = [[] for _ in range(k)]
        if even:
            if not s.send_first:
                src_r, src_l = halves(r, 0, half), halves(lb, half, self.cs)
                if s.is_control:   # sent once the last einsums are done
                    src_r, src_l = held(src_r, (pr, pl)), held(src_l, (pr, pl))
                ra = lay.send(src_r, lay.right())
                lb_b = lay.send(src_l, lay.left())
            if s.is_control:   # no antipodal einsum before both halves have arrived
                ra, lb_b = held(ra, (ra, lb_b)), held(lb_b, (ra, lb_b))
            for m, (ag, w) in enumerate(zip(self.ags, ws, strict=True)):
                for c in range(s.chunks):
                    pa = ag.partial(ra[c], w, at(n // 2), c, 0)
                    pb = ag.partial(lb_b[c], w, at(n // 2), c, half)
                    anti[m].append(pa + pb if ag.acc else jnp.concatenate([pa, pb], axis=ag.odim))
        if loop:
            outs = self.absorb(self.absorb(outs, pr, at(-h)), pl, at(h))
            if even:
                outs = self.absorb(outs, anti, at(n // 2))
            return self.done(outs)
        results = []
        for m, ag in enumerate(self.ags):
            if s.unroll == "full":
                loop_r, loop_l = [y[0][m] for y in ys], [y[1][m] for y in ys]
            else:
                loop_r = [ys[0][0][m]] if ys else []
                loop_l = [ys[0][1][m]] if ys else []
            right_stack = jnp.concatenate(loop_r + [jnp.stack(pr[m])[None]], axis=0)[::-1]  # offsets n-h..n-1
            by_off = [jnp.stack(pl0[m])[None]] + loop_l + [jnp.stack(pl[m])[None]]
            if even:
                by_off.append(jnp.stack(anti[m])[None])
            by_off.append(right_stack)
            results.append(ag.assemble(by_off, i, lay.dtype))
        return tuple(results)


def local_ring(problem: Problem, s: Strategy) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """The ring of one problem: a ring of one member."""
    ag = _AG(problem, s)
    ring = Ring([ag], s)
    fn = ring.bidi if s.direction == "bidi" else ring.uni
    if ag.x_is_lhs:
        return lambda lhs, rhs: fn(lhs, rhs)[0]
    return lambda lhs, rhs: fn(rhs, lhs)[0]

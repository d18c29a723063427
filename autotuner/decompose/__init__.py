"""The decompositions: pure functions of (problem, strategy, mesh). No timing, I/O or globals."""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import Mesh

from autotuner.decompose import allgather, grouped_allgather, reducescatter
from autotuner.decompose._common import check_mesh, loop_trips, wrap
from autotuner.decompose.baseline import (
    comm_out_spec,
    compute_only,
    local_baseline,
    local_comm_only,
)
from autotuner.decompose.canonical import on_canonical
from autotuner.decompose.xla import compiler_options, plain_einsum
from autotuner.problem import GroupedProblem, Problem, ProblemError
from autotuner.strategy import Strategy, StrategyError

__all__ = ["build", "build_keeping", "build_parts", "check_valid", "comm_out_spec", "compiler_options", "loop_trips"]


def check_valid(problem: Problem | GroupedProblem, s: Strategy) -> None:
    """Raise StrategyError if `s` cannot run `problem` (what `space` leaves out). A grouped
    problem's ring runs every member's ring pieces on one shared ring: `s` must suit each member."""
    if s.method in ("baseline", "plain"):
        return
    if isinstance(problem, GroupedProblem):
        for m in problem.members:
            check_valid(m, s)
        return
    pat, n = problem.pattern, problem.axis_size
    if pat.kind == "none":
        raise StrategyError("method", "the einsum is local: only the baseline applies")
    if s.method == "xla_windowed":
        return  # which platforms honour its options is for `space` to say
    s = s.ring() if s.method == "serial" else s   # a control runs wherever its ring does
    if s.direction == "bidi" and n < 3:
        raise StrategyError("direction", f"bidirectional needs at least 3 devices on the ring, got {n}")
    if pat.kind == "reduce_scatter" and s.fuse != "loop":
        raise StrategyError("fuse", "a reduce-scatter ring accumulates in the loop; only 'loop' applies")
    operand = "out" if pat.kind == "reduce_scatter" else pat.operand
    from autotuner.decompose._common import Layout

    blk = Layout(problem, pat.axis, n).local_extent(operand, pat.letter)
    need = s.chunks * (2 if s.direction == "bidi" and n % 2 == 0 else 1)
    if blk % need:
        raise StrategyError("chunks", f"the per-device block of {pat.letter!r} ({blk}) is not divisible "
                                      f"by {need}")
    trips = loop_trips(problem, s.direction)
    if s.unroll == 1 and trips < 2 or s.unroll == 2 and trips < 3:
        raise StrategyError("unroll", f"the loop has {max(trips, 0)} iterations; unroll={s.unroll} "
                                      "would be the same program as unroll='full'")


def build(problem: Problem | GroupedProblem, strategy: Strategy, mesh: Mesh
          ) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """A jittable function of the two global arrays returning the einsum sharded as `out_spec`.

    For a GroupedProblem: a function of `(x, w_1, ..., w_k)` returning the k results (see
    `autotuner.decompose.grouped_allgather`). For `plain` and `xla_windowed` this is the plain GSPMD einsum
    (compiled with `compiler_options(strategy, platform)`, XLA's windowed einsum for the latter)."""
    if isinstance(strategy, dict):
        strategy = Strategy.from_dict(strategy)
    if isinstance(problem, GroupedProblem):
        check_mesh(problem.members[0], mesh)
        check_valid(problem, strategy)
        if strategy.is_baseline:
            return grouped_allgather.wrap(problem, mesh, grouped_allgather.local_baseline(problem))
        if strategy.method in ("plain", "xla_windowed"):
            return grouped_allgather.plain_einsums(problem, mesh)
        return grouped_allgather.wrap(problem, mesh, grouped_allgather.local_ring(problem, strategy))
    if not isinstance(problem, Problem):
        raise TypeError(f"build() needs a Problem, got {type(problem).__name__}")
    check_mesh(problem, mesh)
    check_valid(problem, strategy)
    if strategy.is_baseline:
        return wrap(problem, mesh, local_baseline(problem))
    if strategy.method in ("plain", "xla_windowed"):
        # the plain program; xla_windowed's compile options come from compiler_options(strategy, platform)
        return plain_einsum(problem, mesh)
    impl = allgather if problem.pattern.kind == "all_gather" else reducescatter
    # the ring runs on the matmul the einsum is (size-1 letters dropped, letters that travel
    # together merged), so a 3-D/4-D einsum gets the program of its 2-D form (canonical.py)
    return wrap(problem, mesh, on_canonical(problem, lambda q: impl.local_ring(q, strategy)))


def build_keeping(unit: Problem | GroupedProblem, strategy: Strategy, mesh: Mesh
                  ) -> Callable[..., tuple[jax.Array, ...]]:
    """`build`'s ring for an all-gather problem (or group) that also returns the gathered operand,
    for a program that uses the gathered value elsewhere too (a weight gradient reusing the
    forward input), so that its all-gather goes away: `fn(x, *weights) -> (*results, gathered)`,
    x the gathered operand whichever side of the einsum(s) it stands on, `gathered` laid out
    without the collective axis. Each block is copied into `gathered` as it passes; the ring is
    the grouped one, and a single problem's runs on its canonical matmul as `build`'s does."""
    if isinstance(strategy, dict):
        strategy = Strategy.from_dict(strategy)
    members = unit.members if isinstance(unit, GroupedProblem) else (unit,)
    if members[0].pattern.kind != "all_gather" or strategy.method != "ring":
        raise StrategyError("method", "keeping the gathered operand needs a ring over an all-gather")
    check_valid(unit, strategy)
    return grouped_allgather.wrap_keeping(members, strategy, mesh)


def build_parts(problem: Problem | GroupedProblem, mesh: Mesh) -> tuple[Callable, Callable]:
    """(collective alone, einsum alone) for the harness's bound; see baseline.py (grouped_allgather.py for
    a grouped problem: the one gather alone, the k einsums alone).

    The collective alone returns what the collective produces, laid out as `comm_out_spec`: for an
    all-gather that is the gathered operand (its rank, not the einsum output's: `abc,cde->abde`
    gathers a rank-3 operand into a rank-4 einsum), for a reduce-scatter the scattered output."""
    if isinstance(problem, GroupedProblem):
        return grouped_allgather.wrap_comm(problem, mesh), grouped_allgather.compute_only(problem, mesh)
    check_mesh(problem, mesh)
    if problem.pattern.kind == "none":
        raise ProblemError("problem", "a local einsum has no collective to time")
    comm = wrap(problem, mesh, local_comm_only(problem), comm_out_spec(problem))
    return comm, compute_only(problem, mesh)


__all__ += ["ProblemError"]

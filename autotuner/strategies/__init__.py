"""The decompositions: pure functions of (problem, strategy, mesh). No timing, I/O or globals."""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import Mesh

from autotuner.problem import Problem, ProblemError
from autotuner.strategies import allgather, reducescatter
from autotuner.strategies._common import check_mesh, loop_trips, wrap
from autotuner.strategies.baseline import compute_only, local_baseline, local_comm_only
from autotuner.strategies.canonical import on_canonical
from autotuner.strategies.xla import compiler_options, plain_einsum
from autotuner.strategy import Strategy, StrategyError

__all__ = ["build", "build_parts", "check_valid", "compiler_options", "loop_trips"]


def check_valid(problem: Problem, s: Strategy) -> None:
    """Raise StrategyError if `s` cannot run `problem` (what `space` leaves out)."""
    if s.is_baseline:
        return
    pat, n = problem.pattern, problem.axis_size
    if pat.kind == "none":
        raise StrategyError("method", "the einsum is local: only the baseline applies")
    if s.method == "xla_windowed":
        return  # which platforms honour its options is for `space` to say
    if s.direction == "bidi" and n < 3:
        raise StrategyError("direction", f"bidirectional needs at least 3 devices on the ring, got {n}")
    if pat.kind == "reduce_scatter" and s.fuse != "loop":
        raise StrategyError("fuse", "a reduce-scatter ring accumulates in the loop; only 'loop' applies")
    operand = "out" if pat.kind == "reduce_scatter" else pat.operand
    from autotuner.strategies._common import Layout

    blk = Layout(problem, pat.axis, n).local_extent(operand, pat.letter)
    need = s.chunks * (2 if s.direction == "bidi" and n % 2 == 0 else 1)
    if blk % need:
        raise StrategyError("chunks", f"the per-device block of {pat.letter!r} ({blk}) is not divisible "
                                      f"by {need}")
    trips = loop_trips(problem, s.direction)
    if s.unroll == 1 and trips < 2 or s.unroll == 2 and trips < 3:
        raise StrategyError("unroll", f"the loop has {max(trips, 0)} iterations; unroll={s.unroll} "
                                      "would be the same program as unroll='full'")


def build(problem: Problem, strategy: Strategy, mesh: Mesh) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """A jittable function of the two global arrays returning the einsum sharded as `out_spec`.

    For `xla_windowed` this is the plain GSPMD einsum: compile it with
    `compiler_options(strategy, platform)` to get XLA's windowed einsum."""
    if not isinstance(problem, Problem):
        raise TypeError(f"build() needs a Problem, got {type(problem).__name__}")
    if isinstance(strategy, dict):
        strategy = Strategy.from_dict(strategy)
    check_mesh(problem, mesh)
    check_valid(problem, strategy)
    if strategy.is_baseline:
        return wrap(problem, mesh, local_baseline(problem))
    if strategy.method == "xla_windowed":
        # the plain program; its compile options come from compiler_options(strategy, platform)
        return plain_einsum(problem, mesh)
    impl = allgather if problem.pattern.kind == "all_gather" else reducescatter
    # the ring runs on the matmul the einsum is (size-1 letters dropped, letters that travel
    # together merged), so a 3-D/4-D einsum gets the program of its 2-D form (canonical.py)
    return wrap(problem, mesh, on_canonical(problem, lambda q: impl.local_ring(q, strategy)))


def build_parts(problem: Problem, mesh: Mesh) -> tuple[Callable, Callable]:
    """(collective alone, einsum alone) for the harness's bound; see baseline.py."""
    check_mesh(problem, mesh)
    if problem.pattern.kind == "none":
        raise ProblemError("problem", "a local einsum has no collective to time")
    return wrap(problem, mesh, local_comm_only(problem)), compute_only(problem, mesh)


__all__ += ["ProblemError"]

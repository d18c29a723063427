"""`collective_einsums`: one gathered operand feeding k einsums, with the tuned grouped overlap.

>>> @jax.jit                                                                   # doctest: +SKIP
... def qkv(x, wq, wk, wv):
...     return collective_einsums(["bsd,dhk->bshk"] * 3, x, [wq, wk, wv], mesh=mesh,
...                               out_specs=[P(None, None, "x", None)] * 3)

The counterpart of :func:`autotuner.runtime.collective.collective_einsum` for a
:class:`autotuner.GroupedProblem`: every equation names the shared operand ``x`` first and its
weight second; ``x`` must be sharded so that it is all-gathered (the same way) for every einsum.
The strategy is decided once for the group (service, caches, baseline; process 0 decides in a
multi-process job), by the group's key, and applied as one ring that drives the k einsums.
Returns the k results, in the order of the equations.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from autotuner.problem import GroupedProblem
from autotuner.runtime.collective import chosen_program, problem_for

__all__ = ["collective_einsums", "grouped_problem_for"]



def grouped_problem_for(equations: Sequence[str], x: Any, weights: Sequence[Any], *, mesh: Any,
                        out_specs: Sequence[Any], x_spec: Any = None,
                        weight_specs: Sequence[Any] | None = None) -> GroupedProblem:
    """The GroupedProblem of the k einsums ``jnp.einsum(equations[m], x, weights[m])`` on ``mesh``;
    raises ``ProblemError`` naming what is wrong, ``ValueError`` for mismatched argument lists."""
    k = len(equations)
    if isinstance(equations, str) or len(weights) != k or len(out_specs) != k:
        raise ValueError(f"collective_einsums: {len(equations) if not isinstance(equations, str) else 1} "
                         f"equations, {len(weights)} weights and {len(out_specs)} out_specs: give one of "
                         "each per einsum")
    wspecs = list(weight_specs) if weight_specs is not None else [None] * k
    if len(wspecs) != k:
        raise ValueError(f"collective_einsums: {len(wspecs)} weight_specs for {k} einsums")
    members = tuple(problem_for(eq, x, w, mesh=mesh, out_spec=o, lhs_spec=x_spec, rhs_spec=ws)
                    for eq, w, o, ws in zip(equations, weights, out_specs, wspecs, strict=True))
    return GroupedProblem(members)


def collective_einsums(equations: Sequence[str], x: Any, weights: Sequence[Any], *, mesh: Any,
                       out_specs: Sequence[Any], strategy: Any = "auto", client: Any = None,
                       x_spec: Any = None, weight_specs: Sequence[Any] | None = None) -> tuple[Any, ...]:
    """``tuple(jnp.einsum(eq, x, w) for eq, w in zip(equations, weights))``, each laid out as its
    ``out_specs`` entry, computed with the tuned grouped overlap of the one all-gather of ``x``.
    ``strategy``: "auto" (the client's answer), "baseline", a Strategy or its dict."""

    gp = grouped_problem_for(equations, x, weights, mesh=mesh, out_specs=out_specs, x_spec=x_spec,
                             weight_specs=weight_specs)
    return chosen_program(gp, strategy, client, mesh, "collective_einsums")(x, *weights)

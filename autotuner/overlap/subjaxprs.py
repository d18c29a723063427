"""Sub-jaxprs for the interpreter of `overlap.apply`: an equation whose params hold a jaxpr with a
dot (jit, scan, while, cond, checkpoint/remat, custom_jvp/custom_vjp calls) is bound again with
each such jaxpr traced anew through the interpreter (`evaluate`), with its own input types, at the
path `p + (param index, item index)`, so its dots are tagged or replaced like the others.
`shard_map` bodies are left alone (already manually partitioned).

Uses JAX internals (`partial_eval.trace_to_jaxpr_dynamic`); checked with jax 0.10.2.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jax.extend import core as jcore
from jax.extend import linear_util as lu
from jax.interpreters import partial_eval as pe

SKIP_PRIMS = frozenset({"shard_map"})   # manually partitioned: not ours
Evaluate = Callable[[Any, Any, Any, tuple[int, ...]], list[Any]]   # (jaxpr, consts, args, path) -> outs


def jaxpr_has_dot(jaxpr: Any, memo: dict[int, bool]) -> bool:
    """Whether `jaxpr` or a sub-jaxpr of it (not a shard_map body) holds a dot; memo: id -> answer."""
    hit = memo.get(id(jaxpr))
    if hit is None:
        hit = any(e.primitive.name == "dot_general"
                  or (e.primitive.name not in SKIP_PRIMS and params_have_dot(e.params, memo))
                  for e in jaxpr.eqns)
        memo[id(jaxpr)] = hit
    return hit


def params_have_dot(params: dict[str, Any], memo: dict[int, bool]) -> bool:
    for v in params.values():
        for x in (v if isinstance(v, tuple) else (v,)):
            if isinstance(x, jcore.ClosedJaxpr) and jaxpr_has_dot(x.jaxpr, memo):
                return True
            if isinstance(x, jcore.Jaxpr) and jaxpr_has_dot(x, memo):
                return True
    return False


def rebuild(eqn: Any, p: tuple[int, ...], evaluate: Evaluate, memo: dict[int, bool]) -> dict[str, Any]:
    """The equation's params with every sub-jaxpr that holds a dot traced again through
    `evaluate` (at path p + (param index, item index)); raises where it cannot be."""
    new = dict(eqn.params)
    for k_i, k in enumerate(sorted(eqn.params)):
        v = eqn.params[k]
        items = list(v) if isinstance(v, tuple) else [v]
        if any(isinstance(x, (jcore.ClosedJaxpr, jcore.Jaxpr)) for x in items):
            out = [_sub(x, p + (k_i, j), evaluate, memo) for j, x in enumerate(items)]
            new[k] = tuple(out) if isinstance(v, tuple) else out[0]
    return new


def _sub(x: Any, p: tuple[int, ...], evaluate: Evaluate, memo: dict[int, bool]) -> Any:
    closed = isinstance(x, jcore.ClosedJaxpr)
    jaxpr = x.jaxpr if closed else x
    if not isinstance(jaxpr, jcore.Jaxpr) or not jaxpr_has_dot(jaxpr, memo):
        return x
    consts, in_avals = (x.consts, x.in_avals) if closed else ((), [v.aval for v in jaxpr.invars])
    f = lu.wrap_init(lambda *a: evaluate(jaxpr, consts, a, p), debug_info=jaxpr.debug_info)
    new, out_avals, new_consts = pe.trace_to_jaxpr_dynamic(f, list(in_avals))
    if [(a.shape, a.dtype) for a in out_avals] != [(v.aval.shape, v.aval.dtype) for v in jaxpr.outvars]:
        raise TypeError("the rebuilt jaxpr's outputs differ from the original's")
    if closed:
        return jcore.ClosedJaxpr(new, new_consts)
    if new_consts:
        raise TypeError("the rebuilt body captures constants, which an open jaxpr cannot hold")
    return new

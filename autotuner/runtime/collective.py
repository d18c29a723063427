"""`collective_einsum`: the tuned overlap, chosen at trace time, inside `jax.jit`.

>>> mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))      # doctest: +SKIP
>>> @jax.jit
... def layer(x, w):
...     return collective_einsum("bsd,df->bsf", x, w, mesh=mesh, out_spec=P(None, None, "x"))

The Problem is built from the traced shapes, the dtype and the operands' shardings (read from
``jax.typeof(x).sharding`` on a mesh whose axes are all ``Explicit``; on other meshes pass
``lhs_spec``/``rhs_spec``). With ``strategy="auto"`` the winner comes from the client (service,
then its caches, then the baseline); ``"baseline"``, a :class:`Strategy` or its dict force one.

In a multi-process job every process must run the same program: process 0 decides and
publishes the decision in the `jax.distributed` key-value store; the others wait for it. So
only process 0 needs to reach the service, and a service outage makes every process use the
baseline together. Decisions are remembered per process (one lookup per problem), each an
:class:`autotuner.answer.Answer`: the client's (its ``origin`` the client's), ``process0`` on the
other processes of a job, ``unconfigured`` without a client, ``no-kv-store`` or ``error`` where
every process takes the baseline, ``in-job`` where `overlap(tune=...)` measured it; its
``device_key`` is "" where no lookup was made.
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from collections.abc import Sequence
from typing import Any

from autotuner.answer import Answer
from autotuner.errors import AutotunerError
from autotuner.problem import Problem
from autotuner.strategy import Strategy, StrategyError, parse_choice

__all__ = ["DECISIONS", "DecisionError", "DecisionTable", "collective_einsum", "decisions", "decisions_for",
           "problem_for"]

log = logging.getLogger("autotuner.runtime.collective")

DECISION_TIMEOUT_S = 600.0  # how long processes > 0 wait for process 0's decision
_KV_PREFIX = "autotuner/collective_einsum/v3/"  # v3: the payload is a decision's Answer JSON
_ASKED: dict[str, int] = {}   # problem key -> how many decisions of it this process has shared


class DecisionError(AutotunerError, RuntimeError):
    """The processes of a job could not agree on a strategy."""


def _baseline(problem: Problem, origin: str) -> Answer:
    """The baseline, decided without a lookup (``origin`` says why: unconfigured, no-kv-store, error)."""
    return Answer(Strategy.baseline(), "default", None, None, None, None, problem.key, "", origin=origin)


class DecisionTable:
    """The decisions made with one client, by problem key: one lookup (and, in a multi-process job,
    one key-value exchange) per problem. Every trace with the same client picks the same program
    for the same problem. Each client owns its table (`decisions_for`); `DECISIONS` is the one of
    no client (every answer the baseline), so a pass without a service never answers for a later
    one with a service."""

    def __init__(self) -> None:
        self._decisions: dict[str, Answer] = {}
        self._lock = threading.Lock()

    def snapshot(self) -> dict[str, Answer]:
        return dict(self._decisions)

    def clear(self) -> None:
        with self._lock:
            self._decisions.clear()

    def put(self, decision: Answer) -> None:
        """Replace the decision for its problem (in-job tuning measured it: `overlap(tune=...)`);
        every later trace in this process uses it. Each process of a job puts the same one."""
        with self._lock:
            self._decisions[decision.problem_key] = decision

    def decide(self, problem: Problem, client: Any, shared: bool = True) -> Answer:
        """The remembered decision for `problem`, else a new one: looked up (process 0) and
        shared through the distributed key-value store (the other processes). `shared=False`:
        a new one is this process's own lookup, neither shared nor remembered (the compiler pass
        agrees on its whole plan instead: `overlap.agree`)."""
        import jax

        key = problem.key
        hit = self._decisions.get(key)
        if hit is not None:
            return hit
        if not shared:
            return _local_decision(problem, client)
        with self._lock:
            hit = self._decisions.get(key)
            if hit is not None:
                return hit
            if jax.process_count() == 1:
                decision = _local_decision(problem, client)
            else:
                decision = _shared_decision(problem, client)
            self._decisions[key] = decision
            return decision


DECISIONS = DecisionTable()
_TABLES: weakref.WeakKeyDictionary[Any, DecisionTable] = weakref.WeakKeyDictionary()
_TABLES_LOCK = threading.Lock()


def decisions_for(client: Any) -> DecisionTable:
    """The decision table of `client` (None: the default client from AUTOTUNER_SERVICE_URL, else
    `DECISIONS`, the table of no client). A client keeps its table for its lifetime."""
    if client is None:
        from autotuner.runtime.client import default_client

        client = default_client()
        if client is None:
            return DECISIONS
    with _TABLES_LOCK:
        table = _TABLES.get(client)
        if table is None:
            table = _TABLES[client] = DecisionTable()
        return table


def decisions(client: Any = None) -> dict[str, Answer]:
    """The decisions made with `client` (see `decisions_for`), by problem key."""
    return decisions_for(client).snapshot()


# -- the Problem from traced operands -------------------------------------------------------------

def _entries(spec: Any, rank: int, what: str) -> tuple[Any, ...]:
    entries = list(spec) if spec is not None else []
    if len(entries) > rank:
        raise ValueError(f"collective_einsum: {what} {tuple(entries)} has {len(entries)} entries for a "
                         f"rank-{rank} operand")
    entries += [None] * (rank - len(entries))
    out = []
    for e in entries:
        if e is None or isinstance(e, str):
            out.append(e)
        elif isinstance(e, (tuple, list)):
            out.append(tuple(e) if len(e) != 1 else e[0])
        else:
            raise ValueError(f"collective_einsum: {what} entry {e!r} is not None, a mesh axis name or "
                             "a tuple of names")
    return tuple(out)


def _operand_spec(x: Any, given: Any, mesh: Any, name: str) -> tuple[Any, ...]:
    import jax
    from jax.sharding import AxisType, NamedSharding

    rank = len(x.shape)
    if given is not None:
        return _entries(given, rank, f"{name}_spec")
    if all(t == AxisType.Explicit for t in mesh.axis_types):
        sharding = jax.typeof(x).sharding
        if isinstance(sharding, NamedSharding) or hasattr(sharding, "spec"):
            return _entries(sharding.spec, rank, f"the sharding of {name}")
    if not isinstance(x, jax.core.Tracer) and isinstance(getattr(x, "sharding", None), NamedSharding):
        return _entries(x.sharding.spec, rank, f"the sharding of {name}")
    raise ValueError(
        f"collective_einsum: cannot read how {name} is sharded: the mesh has axes that are not "
        f"Explicit ({dict(zip(mesh.axis_names, mesh.axis_types, strict=True))}), so the sharding is "
        f"not part of the traced type. Pass {name}_spec=PartitionSpec(...), or build the mesh with "
        f"axis_types=(AxisType.Explicit, ...)")


def problem_for(equation: str, lhs: Any, rhs: Any, *, mesh: Any, out_spec: Any,
                lhs_spec: Any = None, rhs_spec: Any = None) -> Problem:
    """The Problem of ``jnp.einsum(equation, lhs, rhs)`` on ``mesh`` (traced or concrete arrays);
    raises ``ProblemError`` naming what is wrong."""
    import jax.numpy as jnp

    dtype = jnp.result_type(lhs.dtype, rhs.dtype).name
    ls = _operand_spec(lhs, lhs_spec, mesh, "lhs")
    rs = _operand_spec(rhs, rhs_spec, mesh, "rhs")
    out_rank = len(equation.split("->", 1)[1].strip()) if "->" in equation else 0
    os_ = _entries(out_spec, out_rank, "out_spec")

    def js(spec: Sequence[Any]) -> list[Any]:
        return [list(e) if isinstance(e, tuple) else e for e in spec]

    return Problem.from_dict({
        "equation": equation,
        "lhs": {"shape": [int(d) for d in lhs.shape], "spec": js(ls)},
        "rhs": {"shape": [int(d) for d in rhs.shape], "spec": js(rs)},
        "out_spec": js(os_),
        "dtype": dtype,
        "mesh": {str(a): int(n) for a, n in mesh.shape.items()},
    })


# -- the decision ---------------------------------------------------------------------------------

def _local_decision(problem: Problem, client: Any) -> Answer:
    if client is None:
        from autotuner.runtime.client import default_client

        client = default_client()
    if client is None:
        return _baseline(problem, "unconfigured")
    return client.lookup(problem, client.device)  # the client's fingerprint: Device.current() by default


def _kv_client() -> Any:
    from jax._src import distributed

    return distributed.global_state.client


def _shared_decision(problem: Problem, client: Any) -> Answer:
    import jax

    kv = _kv_client()
    if kv is None:
        log.warning("collective_einsum: %d processes but no jax.distributed key-value store; every "
                    "process uses the baseline so that they agree", jax.process_count())
        return _baseline(problem, "no-kv-store")
    with _TABLES_LOCK:   # the n-th decision of this problem in the job: the same n on every process
        n = _ASKED[problem.key] = _ASKED.get(problem.key, -1) + 1
    name = f"{_KV_PREFIX}{problem.key}/{n}"
    if jax.process_index() == 0:
        try:
            decision = _local_decision(problem, client)
        except Exception:  # noqa: BLE001 - the others wait for a decision: publish the baseline
            log.exception("collective_einsum: the lookup failed; every process uses the baseline")
            decision = _baseline(problem, "error")
        kv.key_value_set(name, json.dumps(decision.to_json()), allow_overwrite=True)
        return decision
    try:
        text = kv.blocking_key_value_get(name, int(DECISION_TIMEOUT_S * 1000))
        return Answer.from_json(json.loads(text), "process0", keyed=False)  # device_key may be ""
    except Exception as e:  # noqa: BLE001 - any failure here means the processes cannot agree
        raise DecisionError(
            f"collective_einsum: process {jax.process_index()} got no strategy from process 0 for "
            f"{problem.describe()} within {DECISION_TIMEOUT_S:g}s ({type(e).__name__}: {e}); does "
            "process 0 trace the same program?") from e


# -- the op ---------------------------------------------------------------------------------------

def collective_einsum(equation: str, lhs: Any, rhs: Any, *, mesh: Any, out_spec: Any,
                      strategy: Any = "auto", client: Any = None, lhs_spec: Any = None,
                      rhs_spec: Any = None) -> Any:
    """``jnp.einsum(equation, lhs, rhs)`` laid out as ``out_spec`` on ``mesh``, computed with the
    tuned overlap of its collective (see the module docs). ``client``: an
    :class:`autotuner.runtime.client.Client` (default: :func:`autotuner.runtime.client.default_client`, from
    ``AUTOTUNER_SERVICE_URL``; none configured means the baseline)."""
    problem = problem_for(equation, lhs, rhs, mesh=mesh, out_spec=out_spec, lhs_spec=lhs_spec,
                          rhs_spec=rhs_spec)
    return chosen_program(problem, strategy, client, mesh, "collective_einsum")(lhs, rhs)


def chosen_program(problem: Any, strategy: Any, client: Any, mesh: Any, op: str) -> Any:
    """`build(problem, s, mesh)` for the forced strategy, or the one every process agrees on for
    "auto"; an "auto" choice that cannot run this problem falls back to the baseline (the same on
    every process: a pure check of the same problem and strategy), a forced one raises."""
    from autotuner.decompose import build

    try:
        mode, chosen = parse_choice(strategy, callables=False)
    except StrategyError:
        raise
    except ValueError as e:
        raise ValueError(f"{op}: {e}") from None
    if mode == "auto":
        chosen = decisions_for(client).decide(problem, client).strategy
    try:
        return build(problem, chosen, mesh)
    except StrategyError as e:
        if strategy != "auto":
            raise
        log.warning("%s: %s cannot run %s (%s); using the baseline", op, chosen.key, problem.describe(), e)
        return build(problem, Strategy.baseline(), mesh)

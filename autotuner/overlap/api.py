"""`overlap(fn)`: the compiler pass that applies the tuned decompositions to an unmodified program.

>>> step = overlap(train_step)                     # doctest: +SKIP
>>> print(step.plan(params, batch))                # what will change, pair by pair
>>> loss, params = step(params, batch)             # like jax.jit(train_step)(params, batch): the example's step returns (loss, new params)

How it works, per input signature (tree, shapes, dtypes, shardings, static values), once:

1. *Tag.* `fn` is traced to a jaxpr (for a training step written with `value_and_grad` the
   backward einsums are ordinary `dot_general` equations there) and evaluated by the interpreter
   of `overlap.apply` under `jax.jit(..., **jit_kwargs)`, which binds every dot under a
   name-stack scope `__overlapT__`, T the equation's path through the jaxpr and its sub-jaxprs.
2. *Find.* That program is compiled once with the example arguments; `overlap.find.find_sites` reads
   the HLO around XLA's SPMD partitioner and maps each all-gather -> dot and dot -> reduce-scatter
   pair to a Problem. The tag in the dot's op_name names the equation exactly; its operand and
   result types are checked against the Problem (shapes, dimension numbers, dtypes).
3. *Choose.* Per pair, a Strategy: `strategy="auto"` asks the client through
   `collective_einsum`'s decision table of that client (`decisions_for(client)`; in a multi-process job
   process 0 decides and publishes it in the `jax.distributed` key-value store, so every process
   applies the same plan), and applies it only when it is `tuned` with a confidence interval above 1.0 (never slower
   by default: nearest, model or default answers stay baseline). `"baseline"` applies nothing; a
   Strategy applies it wherever `space(problem)` offers it; a callable `Problem -> Strategy` (or
   its dict) chooses per pair. The dots one all-gather feeds (Q/K/V, gate/up of a gated MLP)
   are one `GroupedProblem`, as extraction groups them: one choice, made by the group's key,
   for all of them (the callable gets the GroupedProblem). An all-gather whose value is also
   used elsewhere (the forward input a weight gradient reuses, the output gradient both backward
   dots read: a shared gather) is run by the ring of its first pair, which also keeps the
   gathered value (`decompose.build_keeping`) for the other dots of the same jaxpr; a second
   pair on that gather is then "served" (its dot reads the kept copy, no second ring). Where no
   dot can take the kept value the pair stays baseline under `auto` (the gather would stay
   beside the ring); a forced choice is applied with a note. With Explicit layouts, an operand
   relaid out away from the dot (e.g. outside the loop body) keeps a pair baseline the same way.
4. *Apply.* The interpreter replaces each chosen dot by `build(problem, strategy, mesh)(lhs,
   rhs)`, taking the operand from before its relayout and handing the result to the relayout
   after it (see `overlap.apply`); a group's ring runs at the first of its dots and each dot
   takes its own result; a ring that keeps its gather runs before the first equation that needs
   the gathered value, which takes the kept copy; baseline pairs keep their equation (the baseline is exactly
   plain jit). The rewritten program is compiled; with Auto layouts (GSPMD may lay it out
   differently) it is analysed again for pairs that appear only now, which are chosen for in turn
   (at most `MAX_ROUNDS` analyses). Past the memory bound (`overlap.memory`), decompositions are
   shed and the program compiled again. That executable is what calls run (no compile on the
   first call), unless `jit_kwargs` has static arguments (then `jax.jit` of the rewritten program,
   compiled on call).

Tuning inside the job: `overlap(fn, client=Client(url, token=WRITE), tune="missing",
tune_budget_s=60)`. On the first call (or `plan`/`lower`) of a signature, each unit (a pair's
problem, or a group's GroupedProblem) whose answer from the client is not `tuned` for this job's
device, and that has no in-program evidence, is measured in place before step 3 chooses: on the
mesh of the program's arguments, `measure.run_session` with a `LocalRunner`, the baseline against
the likeliest candidates (the client's `model`/`nearest` pick first, then `space(problem)`'s
order), in program order until `tune_budget_s` is spent (units met after that stay as they were,
"budget spent"). In a multi-process job process 0 decides what to measure and publishes it in
the key-value store; every process measures in lockstep (`overlap.injob.JaxSync`). The session
is stored through `Client.upload`: `POST /v1/results` with the client's token (the body `autotuner
tune --service` sends), into the snapshot file for an offline client, nowhere without a token
(the plan says which); the answer (the service's, recomputed over all it holds, else the
session's winner by the same rule) replaces the client's and its decision table's for that problem, and
step 3 applies it under the never-slower rule. Those rows have `source == "in-job"` and a note
with what it cost (seconds, strategies tried, where it was stored); `plan().notes` has the total.
A later job with the same shapes gets `tuned` answers and measures nothing. `tune=None` (the
default) measures nothing.

Limits (each pair concerned stays plain jit and `plan()` says why; nothing raises):
- only pairs `extract` maps to a Problem (f32/bf16/f16 dots whose layout classifies as the
  collective the HLO shows; not inside shard_map);
- a dot whose result type differs from its operands' (`preferred_element_type=f32` on bf16);
- a dot inside a higher-order primitive the interpreter cannot rebuild (the rebuilt jaxpr must
  keep its input/output types; open-jaxpr bodies must not capture constants);
- `xla_windowed` (a whole-program compile option, not a per-pair rewrite);
- meshes mixing Explicit and Auto axes; programs whose arguments carry no NamedSharding; calls on
  traced values (inside another jit, grad or vmap), where the argument layouts are unknown: the
  pass is meant for the outermost function (the training step), and these run as plain jit.
- an all-gather -> dot pair whose dot also contracts a dimension sharded over another axis (the
  weight gradients on a data x model mesh need an all-reduce over `data` too): not a Problem.
Flax NNX objects among the arguments (a Module, an Optimizer: a step written for `nnx.jit`, which
updates them in place) are split into their state, the pass compiles the step as a function of it,
and the objects are updated after each call, as `nnx.jit` does (`overlap.nnx`). Any other argument
changed in place raises `OverlapError`: any jit, `jax.jit` included, would drop that update on every
call (`arguments.ArgumentsChanged`).
Cost, per input signature: one trace of `fn`; one analysis compile of the tagged program at the
backend's cheapest options, stopped before code generation on CPU (only its partitioned HLO and
buffer assignment are read: `hlo.compile.analysis_stop`); one compile of the rewritten program
(analysed too with Auto layouts, reading the propagated HLO only when a pair is new there; more
rounds only when new pairs appear). With JAX's
persistent compilation cache configured, the partitioned texts are kept beside it, so a restarted
job compiles nothing for the analysis and finds the rewritten executable in JAX's cache. A program
with nothing to rewrite is plain `jax.jit`, compiled on its first call. Python's full garbage
collections wait while a signature is prepared (`_no_full_collections`). `bench/pass_cost.py`
measures it against plain jit.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from autotuner.errors import AutotunerError
from autotuner.overlap import nnx
from autotuner.overlap.injob import DEFAULT_BUDGET_S
from autotuner.overlap.injob import MODES as TUNE_MODES
from autotuner.overlap.memory import DEFAULT_BOUND, check_bound
from autotuner.overlap.pipeline import Build
from autotuner.overlap.pipeline import Prepared as _Prepared
from autotuner.overlap.plan import Plan, PlanRow
from autotuner.strategy import parse_choice

__all__ = ["Overlapped", "OverlapError", "Plan", "PlanRow", "overlap"]

log = logging.getLogger("autotuner.overlap")


class OverlapError(AutotunerError, ValueError):
    """Bad arguments to `overlap` (the program itself never makes it raise: pairs fall back)."""


# -- arguments ------------------------------------------------------------------------------------

def _leaf_key(x: Any) -> Any:
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is not None and dtype is not None:
        return ("array", tuple(shape), str(dtype), _layout_key(getattr(x, "sharding", None)),
                bool(getattr(x, "weak_type", False)))
    try:
        hash(x)
        return ("value", type(x), x)
    except TypeError:
        return ("object", id(x))


@functools.lru_cache(maxsize=1024)   # a step's leaves share a few shardings: each is normalized once
def _layout_key(sharding: Any) -> Any:
    """A NamedSharding as the layout it is: a compiled step's outputs come back as P('model',) where
    its inputs were P('model', None, None), and fed back (a training loop) they must not prepare the
    step a second time. Trailing unsharded dimensions are dropped; other shardings are themselves."""
    from jax.sharding import NamedSharding

    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = list(sharding.spec)
    while spec and spec[-1] is None:
        spec.pop()
    return ("named", sharding.mesh, tuple(spec), sharding.memory_kind)


def _mesh_of(args: Any, jit_kwargs: dict[str, Any]) -> Any:
    """The jax Mesh of the arguments' (or in_shardings') NamedShardings; None if none."""
    import jax
    from jax.sharding import NamedSharding

    found = None
    for leaf in jax.tree.leaves((args, jit_kwargs.get("in_shardings"), jit_kwargs.get("out_shardings")),
                                is_leaf=lambda x: isinstance(x, NamedSharding)):
        sh = leaf if isinstance(leaf, NamedSharding) else getattr(leaf, "sharding", None)
        if isinstance(sh, NamedSharding):
            if found is not None and sh.mesh != found:
                raise OverlapError(f"overlap: the arguments use two meshes ({dict(found.shape)} and "
                                   f"{dict(sh.mesh.shape)}); put them on one")
            found = sh.mesh
    return found


# -- the pass -------------------------------------------------------------------------------------

class Overlapped:
    """What `overlap(fn, ...)` returns: call it like `jax.jit(fn, **jit_kwargs)`."""

    def __init__(self, fn: Callable[..., Any], strategy: Any = "auto", client: Any = None,
                 memory: Any = DEFAULT_BOUND, tune: str | None = None,
                 tune_budget_s: float = DEFAULT_BUDGET_S, **jit_kwargs: Any) -> None:
        if not callable(fn):
            raise OverlapError(f"overlap: fn must be callable, got {type(fn).__name__}")
        self.fn = fn
        try:
            self.mode, self.chosen = parse_choice(strategy)
            self.memory = check_bound(memory)
        except ValueError as e:
            raise OverlapError(f"overlap: {e}") from None
        self.tune, self.tune_budget_s = _check_tune(tune, tune_budget_s, self.mode)
        if client is not None and not callable(getattr(client, "lookup", None)):
            raise OverlapError("overlap: client must be a Client (Client(url), Client(offline='snapshot.json')) "
                               f"or None, got {type(client).__name__}")
        self.client = client
        self.jit_kwargs = jit_kwargs
        self._options = (strategy, client, memory, tune, tune_budget_s)
        self._nnx: dict[Any, Overlapped] = {}   # (graphdef, where) -> the pass over the objects' state
        self._cache: dict[Any, _Prepared] = {}
        self._lock = threading.Lock()
        self._warned_traced = False
        functools.update_wrapper(self, fn, updated=())   # the step keeps its name, docs and module

    def __repr__(self) -> str:
        return f"overlap({getattr(self.fn, '__name__', self.fn)!r}, strategy={self.mode})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import jax

        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kwargs))):
            # Inside another transformation the argument layouts are not known: plain jit, said once.
            if not self._warned_traced:
                self._warned_traced = True
                log.warning("overlap: %r was called inside another transformation (jax.jit, jax.grad, "
                            "jax.vmap, shard_map, ...), where its arguments' layouts are not known, so it "
                            "runs as plain jit there. overlap() jits itself: call it on arrays, and put "
                            "it around the outermost function (the whole training step, gradients "
                            "included), not inside one.", self)
            return jax.jit(self.fn, **self.jit_kwargs)(*args, **kwargs)
        inner = self._of_objects(args, kwargs)
        if inner is not None:   # Flax NNX objects: their state in, the state they are left in out
            ov, objs, state, rest, kw = inner
            out, after = ov(state, *rest, **kw)
            nnx.update(objs, after)
            return nnx.restore(out, objs)
        return self._prepare(args, kwargs).call(*args, **kwargs)

    def plan(self, *args: Any, **kwargs: Any) -> Plan:
        """One row per decomposable pair of the program at these arguments (see `PlanRow`)."""
        inner = self._of_objects(args, kwargs)
        if inner is not None:
            ov, _objs, state, rest, kw = inner
            return ov.plan(state, *rest, **kw)
        got = self._prepare(args, kwargs).plan
        return Plan(got, got.notes, got.memory, got.program, got.cost)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """The overlapped program lowered for these arguments (as `jax.jit(...).lower`; with Flax
        NNX objects among them, the program of their state, `overlap.nnx`)."""
        inner = self._of_objects(args, kwargs)
        if inner is not None:
            ov, _objs, state, rest, kw = inner
            return ov.lower(state, *rest, **kw)
        return self._prepare(args, kwargs).jitted.lower(*args, **kwargs)

    def compiled(self, *args: Any, **kwargs: Any) -> Any:
        """The compiled program the calls run for these arguments (a `jax.stages.Compiled`, as
        `jax.jit(...).lower(...).compile()` gives: `as_text()`, `memory_analysis()`,
        `cost_analysis()`), without compiling it again where the preparation compiled it; where
        the calls run a jitted function (plain jit, or static arguments), its lowering compiled."""
        import jax

        inner = self._of_objects(args, kwargs)
        if inner is not None:
            ov, _objs, state, rest, kw = inner
            return ov.compiled(state, *rest, **kw)
        prepared = self._prepare(args, kwargs)
        if isinstance(prepared.call, jax.stages.Compiled):
            return prepared.call
        return prepared.jitted.lower(*args, **kwargs).compile()

    def _of_objects(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
        """Where Flax NNX objects are among the arguments (a step written for `nnx.jit`): the pass
        over a pure function of their state (`overlap.nnx`, one per graph), the objects, their
        state and the other arguments; None otherwise."""
        where = nnx.where_objects(args, kwargs)
        if not where:
            return None
        if self.jit_kwargs:
            raise OverlapError(f"{self!r}: with Flax NNX objects among the arguments it takes no jax.jit "
                               f"keyword arguments ({sorted(self.jit_kwargs)}): they would name positions "
                               "of the step, not of the objects' state it compiles")
        graphdef, state, objs, rest, kw = nnx.split(where, args, kwargs)
        key = (graphdef, where, len(args))
        with self._lock:
            ov = self._nnx.get(key)
            if ov is None:
                ov = self._nnx[key] = Overlapped(nnx.pure(self.fn, graphdef, where, len(args)), *self._options)
        return ov, objs, state, rest, kw

    # -- per signature ---------------------------------------------------------------------------
    def _prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Prepared:
        import jax

        leaves, tree = jax.tree.flatten((args, kwargs))
        sig = (tree, tuple(_leaf_key(x) for x in leaves))
        hit = self._cache.get(sig)
        if hit is not None:
            return hit
        with self._lock:
            hit = self._cache.get(sig)
            if hit is None:
                with _no_full_collections():
                    hit = self._cache[sig] = self._build(args, kwargs)
            return hit

    def _jit(self, interp: Any, stop: bool = False) -> Any:
        """The program as `interp` rewrites it, jitted; `stop`: for analysis only, it also returns
        `hlo.compile.analysis_stop()` (its compile ends before code generation)."""
        import functools

        import jax

        from autotuner.hlo.compile import analysis_stop

        def run(*args: Any, **kwargs: Any) -> Any:
            out = interp.run(self.fn, args, kwargs)
            return (out, analysis_stop()) if stop else out

        functools.update_wrapper(run, self.fn, updated=())
        return jax.jit(run, **self.jit_kwargs)

    def _build(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Prepared:
        """One signature prepared: the pipeline of `overlap.pipeline` where the arguments name a
        mesh the pass handles, else plain jit and why."""
        import jax

        mesh = _mesh_of((args, kwargs), self.jit_kwargs)
        plain = jax.jit(self.fn, **self.jit_kwargs)
        if mesh is None:
            return _Prepared(plain, Plan(notes=["no argument has a NamedSharding: plain jit"]))
        if len(set(mesh.axis_types)) > 1:
            return _Prepared(plain, Plan(notes=["the mesh mixes Explicit and Auto axes, which the pass "
                                                "does not handle: plain jit"]))
        from autotuner.overlap.arguments import ArgumentsChanged

        try:
            prepared = Build(self, args, kwargs, mesh, plain).run()
        except ArgumentsChanged as e:
            raise OverlapError(f"{self!r}: {e}") from None
        _say(self, prepared.plan)
        return prepared


def _say(ov: Overlapped, plan: Plan) -> None:
    """One INFO line per prepared program (pairs decomposed, where the choices came from, the
    memory), and a warning where `auto` has no client to ask, so that nothing changes silently."""
    from collections import Counter

    from autotuner.runtime.client import default_client

    rows = [r for r in plan if r.problem is not None]
    sources = Counter(r.source for r in rows)
    log.info("overlap: %r: %d of %d pairs decomposed (choices: %s); %s", ov, sum(r.applied for r in plan),
             len(plan), ", ".join(f"{n} {k}" for k, n in sorted(sources.items())) or "none", plan.memory)
    if ov.mode == "auto" and rows and ov.client is None and default_client() is None:
        log.warning("overlap: %r: no tuning client is configured (no client= and no AUTOTUNER_SERVICE_URL), "
                    "so its %d pair(s) stay as written. Pass client=Client(url) or "
                    "Client(offline='snapshot.json'), or a strategy.", ov, len(rows))


_gc_lock = threading.Lock()
_gc_depth = 0
_gc_saved: tuple[int, ...] = ()


@contextlib.contextmanager
def _no_full_collections() -> Iterator[None]:
    """Python's full (oldest-generation) garbage collections deferred while a signature is
    prepared: each one walks every object alive, a model's and JAX's included, and the trace, the
    HLO texts' parse and the rewrite allocate enough to set off several. The young generations
    are still collected, so only garbage that outlives them waits, for the first full collection
    after. Nested and concurrent preparations share one deferral: the last to finish restores the
    thresholds."""
    global _gc_depth, _gc_saved
    with _gc_lock:
        if _gc_depth == 0:
            _gc_saved = gc.get_threshold()
            gc.set_threshold(*_gc_saved[:2], 2**30)
        _gc_depth += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_depth -= 1
            if _gc_depth == 0:
                gc.set_threshold(*_gc_saved)


def _check_tune(tune: Any, budget: Any, mode: str) -> tuple[str | None, float]:
    import math

    if tune not in TUNE_MODES:
        raise OverlapError(f"overlap: tune must be None or 'missing', not {tune!r}")
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget) or budget <= 0:
        raise OverlapError(f"overlap: tune_budget_s must be a number of seconds above 0, not {budget!r}")
    if tune is not None and mode != "auto":
        raise OverlapError(f"overlap: tune={tune!r} measures what strategy='auto' looks up; "
                           f"it does not go with strategy={mode!r}")
    return tune, float(budget)


def overlap(fn: Callable[..., Any] | None = None, *, strategy: Any = "auto", client: Any = None,
            memory: Any = DEFAULT_BOUND, tune: str | None = None, tune_budget_s: float = DEFAULT_BUDGET_S,
            **jit_kwargs: Any) -> Any:
    """`jax.jit(fn, **jit_kwargs)` with its decomposable collective/einsum pairs, forward and
    backward, run as the chosen decomposition (see the module docs). `memory`: how much the
    compiled step's temp memory may grow over plain jit's (a fraction, default 0.05; None: no
    bound; see `overlap.memory`). `tune="missing"`: measure, in this job, the pairs the client
    has no tuned answer for, within `tune_budget_s` seconds (see the module docs; default None:
    nothing is measured). Usable as a decorator, with or without arguments."""
    if fn is None:
        return lambda f: Overlapped(f, strategy, client, memory, tune, tune_budget_s, **jit_kwargs)
    return Overlapped(fn, strategy, client, memory, tune, tune_budget_s, **jit_kwargs)


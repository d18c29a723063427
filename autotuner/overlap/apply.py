"""The jaxpr interpreter behind `autotuner.overlap`: tag every dot, replace the chosen ones.

`Interpreter(mesh, actions)` evaluates a jaxpr as `jax.core.eval_jaxpr` does (same name stacks,
source tracebacks and equation contexts) while tracing, with two differences:

- the `dot_general` equations named in `actions` ({tag: Action}) are replaced by
  `build(problem, strategy, mesh)` applied to their operands (built once per problem and strategy
  and bound as a `jax.jit` call wherever the problem recurs: `_ring`). The k dots of a grouped gather
  (one `GroupedProblem`, all in one jaxpr) are computed together at the first of them the
  evaluation reaches, from the shared operand and every member's weight (each must be computed
  by then; otherwise the group stays plain), and each member's result is bound at its own dot.
  An action with `keep` (a shared gather) runs `build_keeping`, whose extra result, the gathered
  operand, replaces the operand of the other equations of the jaxpr that read the gathered value
  (`_gather_users`); it runs at the first of those or of its own dots (`_early`). Value-preserving layout equations
  (`reshard`, `sharding_constraint`) in front of an operand are looked through, so that a
  decomposed all-gather takes the operand *before* its gather (the old gather becomes dead code);
  behind the result, a relayout to the problem's output layout (the `reshard` after a dot whose
  all-reduce + slice is the reduce-scatter) takes the decomposition's result directly;
- every other `dot_general` is bound under one extra name-stack scope `__overlapT__`, T the
  equation's *path* (its index in the jaxpr, and the index of each sub-jaxpr and equation on the
  way down: `3_1_0_7`). The scope lands in the HLO op_name of the dot, so a pair that extraction
  finds in the partitioned HLO names its equation exactly, even when several equations share
  source line and name stack (layers of a Python loop, forward and recomputed forward).

Sub-jaxprs (jit, scan, while, cond, checkpoint/remat, custom_jvp/custom_vjp calls) that contain
a dot are rebuilt by this interpreter (`overlap.subjaxprs`); `shard_map` bodies are left alone
(already manual). An equation that cannot be rebuilt is bound unchanged: its dots stay plain and
`failed` says why.

Uses JAX internals (`jax._src.source_info_util`); checked with jax 0.10.2.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
from jax._src import source_info_util as siu
from jax.extend import core as jcore
from jax.sharding import AxisType, NamedSharding

from autotuner.overlap.arguments import check_unchanged
from autotuner.overlap.dotview import IDENTITY, DotInfo, Perm, Spec, View, permute
from autotuner.overlap.subjaxprs import SKIP_PRIMS, params_have_dot, rebuild
from autotuner.problem import Entry, GroupedProblem, Problem
from autotuner.strategy import Strategy

log = logging.getLogger("autotuner.overlap")

LAYOUT_PRIMS = frozenset({"reshard", "sharding_constraint"})  # identity on values
TAG_PREFIX = "__overlap"


def _graph(jaxpr: Any) -> tuple[dict[Any, Any], dict[Any, list[Any]]]:
    """(each value's producing equation, each value's consuming equations: None for the jaxpr's
    own result)."""
    producer = {o: e for e in jaxpr.eqns for o in e.outvars}
    consumers: dict[Any, list[Any]] = {}
    for e in jaxpr.eqns:
        for v in e.invars:
            if not isinstance(v, jcore.Literal):
                consumers.setdefault(v, []).append(e)
    for v in jaxpr.outvars:
        if not isinstance(v, jcore.Literal):
            consumers.setdefault(v, []).append(None)
    return producer, consumers


def tag_of(path: Sequence[int]) -> str:
    return "_".join(str(i) for i in path)


def spec_of(aval: Any) -> Spec | None:
    """The explicit layout of an aval as Problem-style entries; None where it carries none."""
    sh = getattr(aval, "sharding", None)
    mesh = getattr(sh, "mesh", None)
    if sh is None or mesh is None or getattr(mesh, "empty", True):
        return None
    if not all(t == AxisType.Explicit for t in mesh.axis_types):
        return None
    rank = len(aval.shape)
    entries = list(sh.spec) + [None] * (rank - len(sh.spec))
    out: list[Entry] = []
    for e in entries[:rank]:
        out.append(() if e is None else (e,) if isinstance(e, str) else tuple(e))
    return tuple(out)


def _members(act: Any) -> tuple[Problem, ...]:
    return act.problem.members if isinstance(act.problem, GroupedProblem) else (act.problem,)


def _positions(tags: Sequence[str], jaxpr: Any, path: tuple[int, ...]) -> list[int] | None:
    """The positions in `jaxpr` (at `path`) of the dots `tags` name; None if any is elsewhere."""
    prefix = tag_of(path) + "_" if path else ""
    rests = [t[len(prefix):] if t.startswith(prefix) else "" for t in tags]
    if not all(r.isdigit() and int(r) < len(jaxpr.eqns) for r in rests):
        return None
    return [int(r) for r in rests]


@dataclass(frozen=True)
class Action:
    """Replace a dot by `build(problem, strategy)`; for a GroupedProblem, `tags` are the dots of
    its members in member order (this one among them)."""

    problem: Problem | GroupedProblem
    strategy: Strategy
    tags: tuple[str, ...] = ()
    keep: bool = False     # the gathered value has other users: the ring also yields it for them
    strict: bool = False   # keep or nothing (auto): if no other user can take it, the dot stays plain
    view: View = IDENTITY  # a single Problem that the HLO reads from the traced dot changed
    #                        (`View`): its operands are taken as the Problem's, its result given back


def _operand_index(m: Problem, view: View) -> int:
    """The traced dot's operand position of the Problem's gathered (all-gather) or lhs operand."""
    return (0 if m.pattern.operand == "lhs" else 1) ^ int(view.swapped)


@dataclass
class Interpreter:
    """Evaluate jaxprs while tracing; see the module docs. Dots not in `actions` are tagged."""

    mesh: Any = None
    actions: dict[str, Action] = field(default_factory=dict)
    infos: dict[str, DotInfo] = field(default_factory=dict)
    applied: set[str] = field(default_factory=set)
    failed: dict[str, str] = field(default_factory=dict)   # tag or eqn path -> why not applied
    _has_dot: dict[int, bool] = field(default_factory=dict)
    _pos: dict[int, dict[int, int]] = field(default_factory=dict)   # id(jaxpr) -> {id(eqn): position}
    _replaced: dict[tuple[int, ...], set[int]] = field(default_factory=dict)  # jaxpr path -> ids of its replaced dots
    _pending: dict[str, Any] = field(default_factory=dict)   # group member tag -> its computed result
    _subst: dict[int, dict[int, Any]] = field(default_factory=dict)  # id(eqn) -> {operand: kept gather}
    kept: dict[str, int] = field(default_factory=dict)   # tag -> other users given the kept gather
    kept_span: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # tag -> (from, to, of) equations
    served: set[str] = field(default_factory=set)         # equations that got a kept gather
    traced: dict[str, Any] = field(default_factory=dict)  # the program's jaxpr and its rings (`_ring`), shared by the rounds of one signature

    # -- the program -------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """`fn(*args, **kwargs)` traced to a jaxpr (non-tracer leaves stay static) and evaluated."""
        leaves, tree = jax.tree.flatten((args, kwargs))
        dyn = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.core.Tracer)]

        def flat(*vals: Any) -> Any:
            ls = list(leaves)
            for i, v in zip(dyn, vals, strict=True):
                ls[i] = v
            a, k = jax.tree.unflatten(tree, ls)
            out = fn(*a, **k)
            check_unchanged(ls, (a, k))
            return out

        dvals = [leaves[i] for i in dyn]
        if "jaxpr" in self.traced:
            closed, shape = self.traced["jaxpr"]
        else:
            closed, shape = jax.make_jaxpr(flat, return_shape=True)(*dvals)
            if not any(isinstance(c, jax.core.Tracer) for c in closed.consts):
                self.traced["jaxpr"] = closed, shape
        outs = self.eval(closed.jaxpr, closed.consts, dvals, ())
        return jax.tree.unflatten(jax.tree.structure(shape), outs)

    def eval(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], path: tuple[int, ...]) -> list[Any]:
        env: dict[Any, Any] = {}

        def read(v: Any) -> Any:
            return v.val if isinstance(v, jcore.Literal) else env[v]

        env.update(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))
        producer, consumers = _graph(jaxpr)
        skip: set[int] = set()
        early = self._early(jaxpr, path, producer, consumers)
        for i, eqn in enumerate(jaxpr.eqns):
            if id(eqn) in skip:
                continue
            p = path + (i,)
            name_stack = siu.current_name_stack() + eqn.source_info.name_stack
            for tag, act in early.get(i, ()):
                try:   # a kept gather some user needs before the first member dot: compute it now
                    self._group(act, tag, jaxpr, path, env, producer, consumers, name_stack, i - 1)
                except Exception as e:  # noqa: BLE001 - the member dots try again when reached
                    log.debug("overlap: %s could not run before its dots (%s)", tag, e)
            params = eqn.params
            if eqn.primitive.name == "dot_general":
                tag = tag_of(p)
                self.infos[tag] = self._info(tag, eqn, producer, consumers)
                if tag in self.actions:
                    with siu.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
                        done = self._replace(tag, eqn, env, producer, consumers, skip, name_stack,
                                             jaxpr, path)
                    if done:
                        continue
                name_stack = name_stack.extend(f"{TAG_PREFIX}{tag}__")
            elif eqn.primitive.name not in SKIP_PRIMS and params_have_dot(params, self._has_dot):
                try:
                    params = rebuild(eqn, p, self.eval, self._has_dot)
                except Exception as e:  # noqa: BLE001 - bind it unchanged; its dots stay plain
                    self._fail(p, eqn, e)
                    params = eqn.params
            invals = list(map(read, eqn.invars))
            subst = self._subst.pop(id(eqn), {})
            for j, v in subst.items():
                invals[j] = v
            ans = self._bind_eqn(eqn, p, params, invals, name_stack)
            if subst:   # an operand now arrives gathered: keep the result's explicit layout
                ans = self._relaid(eqn, ans)
                self.served.add(tag_of(p))
            if eqn.primitive.multiple_results:
                for v, a in zip(eqn.outvars, ans, strict=True):
                    env[v] = a
            else:
                env[eqn.outvars[0]] = ans
        return [read(v) for v in jaxpr.outvars]

    def _bind_eqn(self, eqn: Any, p: tuple[int, ...], params: dict[str, Any], invals: list[Any], name_stack: Any) -> Any:
        """The equation bound with `params` (its rebuilt sub-jaxprs); where those fail to bind, the
        failure is recorded and it is bound unchanged (its dots stay plain)."""
        with siu.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
            try:
                return eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))
            except Exception as e:  # noqa: BLE001
                if params is eqn.params:
                    raise
                self._fail(p, eqn, e)
                return eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))

    def _relaid(self, eqn: Any, ans: Any) -> Any:
        outs = list(ans) if eqn.primitive.multiple_results else [ans]
        for k, (o, a) in enumerate(zip(eqn.outvars, outs, strict=True)):
            want = spec_of(o.aval)
            if want is not None and spec_of(jax.typeof(a)) != want:
                outs[k] = jax.reshard(a, NamedSharding(self.mesh, o.aval.sharding.spec))
        return outs if eqn.primitive.multiple_results else outs[0]

    def _fail(self, p: tuple[int, ...], eqn: Any, e: Exception) -> None:
        pre = tag_of(p)
        self.applied = {t for t in self.applied if not (t == pre or t.startswith(pre + "_"))}
        why = f"could not rebuild the {eqn.primitive.name} around it: {type(e).__name__}: {str(e)[:200]}"
        self.failed[pre] = why
        log.debug("overlap: %s at %s", why, pre)

    # -- dots --------------------------------------------------------------------------------
    def _chain(self, v: Any, producer: dict[Any, Any]) -> list[Any]:
        """v and the vars it is a relayout of (through reshard/sharding_constraint)."""
        out = [v]
        while not isinstance(v, jcore.Literal) and v in producer and producer[v].primitive.name in LAYOUT_PRIMS:
            v = producer[v].invars[0]
            out.append(v)
        return out

    def _relayouts(self, o: Any, consumers: dict[Any, list[Any]]) -> list[Any]:
        return [c for c in consumers.get(o, []) if c is not None and c.primitive.name in LAYOUT_PRIMS
                and c.invars[0] is o]

    def _info(self, tag: str, eqn: Any, producer: dict[Any, Any], consumers: dict[Any, list[Any]]) -> DotInfo:
        lhs, rhs = eqn.invars
        o = eqn.outvars[0]
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        return DotInfo(
            tag, tuple(lhs.aval.shape), tuple(rhs.aval.shape), tuple(o.aval.shape),
            (lhs.aval.dtype.name, rhs.aval.dtype.name, o.aval.dtype.name),
            ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb))),
            siu.summarize(eqn.source_info),
            [spec_of(v.aval) for v in self._chain(lhs, producer)],
            [spec_of(v.aval) for v in self._chain(rhs, producer)],
            spec_of(o.aval), [spec_of(c.outvars[0].aval) for c in self._relayouts(o, consumers)],
            len(self._relayouts(o, consumers)) < len(consumers.get(o, [])),
            self._transposed(lhs, producer), self._transposed(rhs, producer))

    def _transposed(self, v: Any, producer: dict[Any, Any]) -> Perm | None:
        """The permutation of the `transpose` equation that gives `v` (looked through relayouts)."""
        e = producer.get(self._chain(v, producer)[-1])
        return tuple(e.params["permutation"]) if e is not None and e.primitive.name == "transpose" else None

    def _pick(self, v: Any, spec: Spec, producer: dict[Any, Any]) -> Any:
        chain = self._chain(v, producer)
        if spec_of(chain[0].aval) is None:      # auto layouts: the value before any relayout
            return chain[-1]
        return next((c for c in chain if spec_of(c.aval) == spec), v)

    def _replace(self, tag: str, eqn: Any, env: dict[Any, Any], producer: dict[Any, Any],
                 consumers: dict[Any, list[Any]], skip: set[int], name_stack: Any,
                 jaxpr: Any, path: tuple[int, ...]) -> bool:
        from autotuner.decompose import build

        act = self.actions[tag]
        problem, strategy = act.problem, act.strategy
        read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]  # noqa: E731
        try:
            if isinstance(problem, GroupedProblem) or act.keep:
                if tag in self.failed:      # the group could not be computed at its first dot
                    return False
                if tag not in self._pending:
                    self._group(act, tag, jaxpr, path, env, producer, consumers, name_stack)
                member = _members(act)[(act.tags or (tag,)).index(tag)]
                out = self._pending.pop(tag)
            else:
                member = problem
                v = act.view
                i = int(v.swapped)   # the traced position of the Problem's lhs
                lhs = read(self._pick(eqn.invars[i], problem.lhs.spec, producer))
                rhs = read(self._pick(eqn.invars[1 - i], problem.rhs.spec, producer))
                fn = self._ring(build, problem, strategy)
                with siu.set_name_stack(name_stack.extend(f"overlap[{strategy.key}]")):
                    out = permute(fn(permute(lhs, v.lhs), permute(rhs, v.rhs)), v.out)
            self._bind(eqn.outvars[0], out, member, env, consumers, skip)
        except Exception as e:  # noqa: BLE001 - this dot stays plain; plan() says why
            why = f"the decomposition could not be applied: {type(e).__name__}: {str(e)[:200]}"
            for t in act.tags or (tag,):
                if t not in self.applied:
                    self.failed.setdefault(t, why)
            log.debug("overlap: %s: %s", tag, why)
            return False
        self.applied.add(tag)
        return True

    def _ring(self, builder: Callable[..., Any], problem: Problem | GroupedProblem, strategy: Strategy
              ) -> Callable[..., Any]:
        """`builder(problem, strategy, mesh)` jitted, once per signature (layers repeat problems: traced
        and lowered once, called at each; XLA inlines the calls, so the program is the inline one's)."""
        rings = self.traced.setdefault("rings", {})
        key = (builder.__name__, problem, strategy)
        fn = rings.get(key)
        if fn is None:
            fn = rings[key] = jax.jit(builder(problem, strategy, self.mesh))
        return fn

    def _group(self, act: Action, tag: str, jaxpr: Any, path: tuple[int, ...], env: dict[Any, Any],
               producer: dict[Any, Any], consumers: dict[Any, list[Any]], name_stack: Any,
               at: int | None = None) -> None:
        """Compute every member of a grouped gather (at the first member dot reached, or where `at`
        says: the equations after it are still to run), or a single problem whose gather is kept,
        into `_pending`; with `keep`, hand the gathered operand to the gathered value's other
        users after that point (`_subst`). Raises (naming why) where it cannot."""
        from autotuner.decompose import build, build_keeping, comm_out_spec

        members = _members(act)
        tags = act.tags or (tag,)
        idx = _positions(tags, jaxpr, path)
        if idx is None:
            raise ValueError(f"the dots of the group are not all in one jaxpr ({', '.join(tags)})")
        eqns = [jaxpr.eqns[i] for i in idx]
        v = act.view
        if v.transposes(members[0].pattern.operand):   # its kept gather would be in the other layout
            raise ValueError("the gathered operand is a transpose that XLA folds into the dot")
        xs, ws = map(list, zip(*(self._operands(m, e, producer, v) for m, e in zip(members, eqns, strict=True)),
                               strict=True))
        weight = v.rhs if members[0].pattern.operand == "lhs" else v.lhs
        if any(x is not xs[0] for x in xs):
            raise ValueError("the dots of the group do not read one gathered value")
        read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]  # noqa: E731
        missing = [t for t, w in zip(tags, ws, strict=True) if not isinstance(w, jcore.Literal) and w not in env]
        if missing:
            raise ValueError(f"the weight of dot {missing[0]} is computed after the group's first dot")
        at = min(idx) if at is None else at
        users = (self._gather_users(xs[0], comm_out_spec(members[0]), set(map(id, eqns)), at, jaxpr, consumers,
                                   path)
                 if act.keep else [])
        if act.keep and act.strict and not users:
            raise ValueError("the gathered value's other users are not dots after it in this jaxpr, "
                             "so its all-gather would stay")
        with siu.set_name_stack(name_stack.extend(f"overlap[{act.strategy.key}]")):
            if users:
                *outs, gathered = self._ring(build_keeping, act.problem, act.strategy)(
                    read(xs[0]), *(permute(read(w), weight) for w in ws))
                outs = [permute(o, v.out) for o in outs]
                for e, j in users:
                    self._subst.setdefault(id(e), {})[j] = gathered
                self.kept[tags[0]] = len(users)
                pos = self._positions_of(jaxpr)
                self.kept_span[tags[0]] = (at, max(pos[id(e)] for e, _ in users), len(jaxpr.eqns))
            elif isinstance(act.problem, GroupedProblem):
                outs = list(self._ring(build, act.problem, act.strategy)(read(xs[0]), *map(read, ws)))
            else:
                x, w = read(xs[0]), permute(read(ws[0]), weight)
                lhs, rhs = (x, w) if members[0].pattern.operand == "lhs" else (w, x)
                outs = [permute(self._ring(build, act.problem, act.strategy)(lhs, rhs), v.out)]
        self._pending.update(zip(tags, outs, strict=True))

    def _early(self, jaxpr: Any, path: tuple[int, ...], producer: dict[Any, Any],
               consumers: dict[Any, list[Any]]) -> dict[int, list[tuple[str, Action]]]:
        """{position: [(tag, action)]}: the kept gathers of this jaxpr whose gathered value some
        other dot reads before the first of their own dots (a weight gradient the transpose
        emits before the input gradient): they run at that position instead."""
        from autotuner.decompose import comm_out_spec

        prefix = tag_of(path) + "_" if path else ""
        out: dict[int, list[tuple[str, Action]]] = {}
        done: set[tuple[str, ...]] = set()
        pos = self._positions_of(jaxpr)
        for tag, act in self.actions.items():
            tags = act.tags or (tag,)
            if not act.keep or tags in done or not tags[0].startswith(prefix):
                continue
            done.add(tags)
            idx = _positions(tags, jaxpr, path)
            if idx is None or jaxpr.eqns[idx[0]].primitive.name != "dot_general":
                continue
            m0 = _members(act)[0]
            x, _ = self._operands(m0, jaxpr.eqns[idx[0]], producer, act.view)
            members = {id(jaxpr.eqns[i]) for i in idx}
            users = self._gather_users(x, comm_out_spec(m0), members, -1, jaxpr, consumers, path)
            first = min((pos[id(e)] for e, _ in users), default=len(jaxpr.eqns))
            if first < min(idx):
                out.setdefault(first, []).append((tags[0], act))
        return out

    def _positions_of(self, jaxpr: Any) -> dict[int, int]:
        """{id(eqn): its position} of a jaxpr's equations, once per jaxpr."""
        pos = self._pos.get(id(jaxpr))
        if pos is None:
            pos = self._pos[id(jaxpr)] = {id(e): i for i, e in enumerate(jaxpr.eqns)}
        return pos

    def _operands(self, m: Problem, eqn: Any, producer: dict[Any, Any], view: View = IDENTITY) -> tuple[Any, Any]:
        """(gathered operand, weight) vars of an all-gather member's dot, before their relayouts."""
        i = _operand_index(m, view)
        x_op, w_op = (m.lhs, m.rhs) if m.pattern.operand == "lhs" else (m.rhs, m.lhs)
        return (self._pick(eqn.invars[i], x_op.spec, producer),
                self._pick(eqn.invars[1 - i], w_op.spec, producer))

    def _gather_users(self, x: Any, gspec: Spec, members: set[int], first: int, jaxpr: Any,
                      consumers: dict[Any, list[Any]], path: tuple[int, ...]) -> list[tuple[Any, int]]:
        """(eqn, operand index) of the equations after position `first` (other than `members`)
        that the gathered operand can serve: those reading a relayout of `x` laid out as the
        gather's result `gspec` (Explicit layouts), and the dots reading `x` itself or a relayout
        of it without an explicit layout (a dot gathers such an operand itself: Explicit sharding
        rules or GSPMD). Other uses take `x` as it is."""
        pos = self._positions_of(jaxpr)
        replaced = self._replaced.get(path)
        if replaced is None:   # a jaxpr object may recur at several paths (one jitted function)
            prefix = tag_of(path) + "_" if path else ""
            replaced = self._replaced[path] = {
                id(jaxpr.eqns[int(r)]) for t in self.actions
                if t.startswith(prefix) and (r := t[len(prefix):]).isdigit() and int(r) < len(jaxpr.eqns)}
        out: list[tuple[Any, int]] = []
        todo, seen = [x], set()
        while todo:
            v = todo.pop()
            spec = spec_of(v.aval)
            for c in consumers.get(v, []):
                if c is None or id(c) in members or id(c) in seen or id(c) in self._subst or id(c) in replaced:
                    continue
                seen.add(id(c))
                if c.primitive.name in LAYOUT_PRIMS and c.invars[0] is v:
                    todo.append(c.outvars[0])
                dot = c.primitive.name == "dot_general"
                if pos.get(id(c), -1) > first and (spec == gspec or dot and (spec is None or v is x)):
                    out += [(c, j) for j, u in enumerate(c.invars) if u is v]
        return out

    def _bind(self, o: Any, out: Any, problem: Problem, env: dict[Any, Any],
              consumers: dict[Any, list[Any]], skip: set[int]) -> None:
        """The dot's result var `o` gets `out`; a relayout of it to the problem's output layout
        takes `out` directly."""
        if tuple(out.shape) != tuple(o.aval.shape) or out.dtype != o.aval.dtype:
            raise ValueError(f"the decomposition gives {out.dtype}{list(out.shape)}, the dot "
                             f"{o.aval.dtype}{list(o.aval.shape)}")
        want = spec_of(o.aval)
        if want is None or want == problem.out_spec:
            env[o] = out
            return
        # dead code unless the result is also used as laid out
        env[o] = jax.reshard(out, NamedSharding(self.mesh, o.aval.sharding.spec))
        for c in self._relayouts(o, consumers):
            if spec_of(c.outvars[0].aval) == problem.out_spec:
                env[c.outvars[0]] = out
                skip.add(id(c))

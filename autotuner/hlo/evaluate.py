"""What the HLO computes about itself: per-partition scalars (dynamic-slice offsets as
functions of the partition id), loop trip counts, how often each computation runs."""

from __future__ import annotations

import logging
import math
import re

import numpy as np

from autotuner.hlo.text import HloModule, Instr

log = logging.getLogger(__name__)

# -- scalar evaluation (dynamic-slice offsets as functions of the partition id) -----------------------

class _NoEval(Exception):
    pass


def _literal(ins: Instr) -> np.ndarray:
    vals = re.findall(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?|true|false", ins.operand_text)
    conv = [1 if v == "true" else 0 if v == "false" else int(float(v)) for v in vals]
    shape = ins.shape or ()
    if len(conv) != math.prod(shape):
        raise _NoEval(ins.name)
    return np.array(conv, dtype=np.int64).reshape(shape)


def _evaluate(mod: HloModule, name: str, pid: int, memo: dict[str, np.ndarray], depth: int = 0) -> np.ndarray:
    if name in memo:
        return memo[name]
    ins = mod.op(name)
    if ins is None or depth > 64 or ins.shape is None or ins.etype is None or ins.etype.startswith("f"):
        raise _NoEval(name)
    if len(ins.shape) > 1:
        raise _NoEval(name)
    op = ins.opcode

    def arg(i: int) -> np.ndarray:
        return _evaluate(mod, ins.operands[i], pid, memo, depth + 1)

    binary = {"add": np.add, "subtract": np.subtract, "multiply": np.multiply,
              "maximum": np.maximum, "minimum": np.minimum}
    if op == "constant":
        v = _literal(ins)
    elif op == "partition-id":
        v = np.array(pid, dtype=np.int64)
    elif op == "replica-id":
        v = np.array(0, dtype=np.int64)
    elif op in ("copy", "convert", "bitcast", "reshape"):
        v = arg(0).reshape(ins.shape)
    elif op in binary:
        v = binary[op](arg(0), arg(1))
    elif op == "divide":
        a, b = arg(0), arg(1)
        if np.any(b == 0):
            raise _NoEval(name)
        v = np.trunc(a / b).astype(np.int64)
    elif op == "remainder":
        a, b = arg(0), arg(1)
        if np.any(b == 0):
            raise _NoEval(name)
        v = np.fmod(a, b)
    elif op == "clamp":
        v = np.clip(arg(1), arg(0), arg(2))
    elif op == "broadcast" and arg(0).ndim == 0:
        v = np.broadcast_to(arg(0), ins.shape).copy()
    elif op == "dynamic-slice":
        base = arg(0)
        if base.ndim != 1:
            raise _NoEval(name)
        size = ins.attr_ints("dynamic_slice_sizes")[0]
        start = int(np.clip(int(arg(1)), 0, base.shape[0] - size))
        v = base[start:start + size]
    else:
        raise _NoEval(name)
    memo[name] = v
    return v


def per_partition(mod: HloModule, name: str) -> np.ndarray | None:
    try:
        return np.array([int(_evaluate(mod, name, p, {}).reshape(-1)[0]) for p in range(mod.num_partitions)])
    except _NoEval:
        return None



def _trip_count(mod: HloModule, w: Instr) -> int | None:
    """Iterations of a counted while loop (the form jax's scan/fori_loop lower to), else None."""
    cond = mod.computations.get(w.attrs.get("condition", "").lstrip("%"), [])
    body = mod.computations.get(w.attrs.get("body", "").lstrip("%"), [])
    init = mod.op(w.operands[0]) if w.operands else None
    if not cond or not body or init is None or init.opcode != "tuple":
        return None
    root = mod.instrs[cond[-1]]
    if root.opcode != "compare" or len(root.operands) != 2:
        return None
    a, b = (mod.op(o) for o in root.operands)
    d = root.attrs.get("direction", "")
    if a is None or b is None:
        return None
    if a.opcode == "constant" and b.opcode == "get-tuple-element":
        a, b = b, a
        d = {"GT": "LT", "GE": "LE", "LT": "GT", "LE": "GE"}.get(d, d)
    if a.opcode != "get-tuple-element" or b.opcode != "constant" or d not in ("LT", "LE"):
        return None
    i = a.attr_ints("index")[0] if a.attr_ints("index") else -1
    broot = mod.instrs[body[-1]]
    if broot.opcode != "tuple" or not 0 <= i < len(broot.operands) or i >= len(init.operands):
        return None
    step = mod.op(broot.operands[i])
    start = mod.op(init.operands[i])
    if step is None or start is None or start.opcode != "constant" or step.opcode != "add":
        return None
    ops = [mod.op(o) for o in step.operands]
    incs = [o for o in ops if o is not None and o.opcode == "constant"]
    gtes = [o for o in ops if o is not None and o.opcode == "get-tuple-element" and o.attr_ints("index") == (i,)]
    if len(incs) != 1 or len(gtes) != 1:
        return None
    try:
        k0, n, inc = (int(_literal(x).reshape(-1)[0]) for x in (start, b, incs[0]))
    except _NoEval:
        return None
    if inc <= 0:
        return None
    n += d == "LE"
    return max(0, -(-(n - k0) // inc))


_CALLS = ("to_apply", "calls", "branch_computations", "true_computation", "false_computation")


def _callees(ins: Instr, keys: tuple[str, ...] = _CALLS) -> list[str]:
    """The computations instruction `ins` calls under the attributes `keys`."""
    return [c for key in keys for c in re.findall(r"%?([\w.\-]+)", ins.attrs.get(key, ""))]


def multiplicity(mod: HloModule) -> dict[str, int]:
    """Computation -> how many times it runs per program call (loop bodies times their trips)."""
    callers: dict[str, list[tuple[str, int]]] = {}
    for n in mod.order:
        ins = mod.instrs[n]
        if ins.opcode == "while":
            trips = _trip_count(mod, ins)
            if trips is None:
                log.debug("extract: loop %s has no countable trip count; its pairs count once", n)
            callers.setdefault(ins.attrs.get("body", "").lstrip("%"), []).append(
                (ins.computation, 1 if trips is None else trips))
        elif ins.opcode in ("call", "conditional", "async-start"):
            for c in _callees(ins):
                callers.setdefault(c, []).append((ins.computation, 1))
    memo: dict[str, int] = {}

    def mult(c: str, depth: int = 0) -> int:
        if c in memo:
            return memo[c]
        if depth > 32 or c not in callers:
            return 1
        memo[c] = sum(mult(p, depth + 1) * k for p, k in callers[c])
        return memo[c]

    return {c: mult(c) for c in mod.computations}


def in_loops(mod: HloModule) -> set[str]:
    """Computations that run inside a while loop: its bodies, and every computation they call."""
    return _reachable(mod, list(mod.loops))


def _reachable(mod: HloModule, todo: list[str], out: set[str] | None = None) -> set[str]:
    """`out` with the computations `todo` and every computation they call, loops' bodies and
    conditions too (not through those already in `out`)."""
    out = set() if out is None else out
    while todo:
        c = todo.pop()
        if c in out or c not in mod.computations:
            continue
        out.add(c)
        for n in mod.computations[c]:
            todo.extend(_callees(mod.instrs[n], (*_CALLS, "body", "condition")))
    return out


# What XLA's Shardy export names a shard_map body it has not inlined yet (XLA:TPU keeps them as
# calls through its partitioner: `xla.sdy.inlinable_manual_computation_body.N`, `..._spmd` after it)
_MANUAL_BODY = "inlinable_manual_computation_body"


def manual_computations(mod: HloModule) -> set[str]:
    """Computations whose dots run on manually partitioned (shard_map) values: those holding a
    shard_map's entry (`SPMDFullToShardShape`), the shard_map bodies XLA calls rather than inlines
    (a call laid out manual, or to a body so named), and every computation they call."""
    entries, todo = set(), []
    for n in mod.order:
        ins = mod.instrs[n]
        if ins.opcode == "custom-call" and "SPMDFullToShardShape" in ins.attrs.get("custom_call_target", ""):
            entries.add(ins.computation)
        elif ins.opcode == "call":
            callee = _callees(ins, ("to_apply",))
            if any(_MANUAL_BODY in c for c in callee) or ins.attrs.get("sharding", "").strip("{}") == "manual":
                todo.extend(callee)
    return _reachable(mod, todo, entries)

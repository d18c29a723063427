"""Helpers shared by tests, the harness and benchmarks: random problems, inputs, tolerances."""

from __future__ import annotations

import copy
import functools
import math
from typing import Any

import numpy as np

from autotuner.problem import GroupedProblem, Problem

# max |result - reference| / max |reference| allowed per dtype
TOLERANCE = {"float32": 2e-5, "bfloat16": 3e-2, "float16": 5e-3}

# A whole program (a training step: ~30 dots forward and backward, then an optimizer such as Adam
# that divides each update by the gradient's own scale) against plain jit: the rounding of a
# reordered sum is amplified where a gradient element is near Adam's epsilon, by an amount that
# depends on the CPU's dot kernels (1.4e-5 on one machine, 1.8e-4 on another, 7e-5 on a 4-process
# lab, for the same keras-hub step). A wrong shard, operand or ring order gives errors of order 1.
STEP_FACTOR = 50


def step_tolerance(dtypes: Any) -> float:
    """The relative error allowed between a whole overlapped program and plain jit (at most 0.1:
    for 16-bit dtypes the factor would allow errors as large as a wrong rewrite's)."""
    return max(min(STEP_FACTOR * TOLERANCE.get(d, TOLERANCE["float32"]), 0.1)
               for d in (set(dtypes) or {"float32"}))


def relative_error(result: Any, reference: Any) -> float:
    r = np.asarray(result, dtype=np.float64)
    ref = np.asarray(reference, dtype=np.float64)
    if r.shape != ref.shape:
        return math.inf
    scale = max(float(np.max(np.abs(ref))) if ref.size else 0.0, 1e-30)
    return float(np.max(np.abs(r - ref))) / scale if ref.size else 0.0


def inputs(problem: Problem, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Uniform(-1, 1) operands, rounded to the problem's dtype (returned as numpy arrays of it)."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    dt = jnp.dtype(problem.dtype)
    a = rng.uniform(-1, 1, problem.lhs.shape).astype(np.float32).astype(dt)
    b = rng.uniform(-1, 1, problem.rhs.shape).astype(np.float32).astype(dt)
    return a, b


def group_inputs(gp: GroupedProblem, seed: int = 0) -> tuple[np.ndarray, ...]:
    """`(x, w_1, ..., w_k)`: the shared operand, then each member's other operand, Uniform(-1, 1)
    rounded to the dtype (what a grouped problem's built functions take)."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    dt = jnp.dtype(gp.dtype)
    shapes = [gp.gathered.shape, *[w.shape for w in gp.weights()]]
    return tuple(rng.uniform(-1, 1, s).astype(np.float32).astype(dt) for s in shapes)


def group_reference(gp: GroupedProblem, x: np.ndarray, *ws: np.ndarray) -> list[np.ndarray]:
    """Each member's einsum in float64."""
    out = []
    for m, w in zip(gp.members, ws, strict=True):
        a, b = (x, w) if m.pattern.operand == "lhs" else (w, x)
        out.append(reference(m, a, b))
    return out


def random_group(rng: np.random.Generator, *, k: int | None = None, **kw: Any) -> GroupedProblem:
    """A random grouped problem: a random all-gather problem (see `random_problem`) and k-1 more
    einsums of the same gathered operand, whose weights' own letters have other sizes, some with
    the operands of the equation swapped (the shared operand as rhs)."""
    first = random_problem(rng, kind="all_gather", **kw)
    k = k or int(rng.integers(2, 4))
    d = first.to_dict()
    x_side = first.pattern.operand
    w_side = "rhs" if x_side == "lhs" else "lhs"
    x_letters = first.eq.lhs if x_side == "lhs" else first.eq.rhs
    w_letters = first.eq.rhs if x_side == "lhs" else first.eq.lhs
    members = [d]
    for _ in range(k - 1):
        m = copy.deepcopy(d)
        for c in w_letters:
            if c in x_letters:
                continue   # shared with the gathered operand: its size is fixed
            f = int(rng.integers(1, 4))
            m[w_side]["shape"][w_letters.index(c)] *= f
        if rng.integers(0, 2):
            lhs, rhs = m["equation"].split("->")[0].split(",")
            m["equation"] = f"{rhs},{lhs}->{m['equation'].split('->')[1]}"
            m["lhs"], m["rhs"] = m["rhs"], m["lhs"]
        members.append(m)
    return GroupedProblem.from_dict({"einsums": members})


def reference(problem: Problem, lhs: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """The einsum in float64 on the full (already dtype-rounded) operands."""
    return np.einsum(problem.equation, np.asarray(lhs, np.float64), np.asarray(rhs, np.float64))


def random_problem(rng: np.random.Generator, *, kind: str | None = None, n: int | None = None,
                   dtype: str | None = None, second_axis: bool | None = None) -> Problem:
    """A random valid problem with a decomposable pattern (all-gather or reduce-scatter).

    Covers both patterns, every dim class, lhs or rhs gathered, several contracting/free/batch
    letters, collective axis sizes 1-8 and an optional second mesh axis on another letter.
    """
    kind = kind or str(rng.choice(["all_gather", "reduce_scatter"]))
    n = n or int(rng.integers(1, 9))
    dtype = dtype or str(rng.choice(["float32", "float32", "bfloat16", "float16"]))
    second = bool(rng.integers(0, 2)) if second_axis is None else second_axis
    second = second and n * 2 <= 8
    letters = iter("abcdefghijklmnopqrstuvwxyz")
    nb, nc = int(rng.integers(0, 3)), int(rng.integers(0, 3))
    nl, nr = int(rng.integers(0, 3)), int(rng.integers(0, 3))
    if kind == "all_gather":
        operand = str(rng.choice(["lhs", "rhs"]))
        cls = str(rng.choice(["free", "batch", "contracting"]))
    else:
        operand, cls = None, str(rng.choice(["free_lhs", "free_rhs", "batch"]))
        nc = max(nc, 1)
    if cls == "batch":
        nb = max(nb, 1)
    if cls == "contracting":
        nc = max(nc, 1)
    if cls == "free" and operand == "lhs" or cls == "free_lhs":
        nl = max(nl, 1)
    if cls == "free" and operand == "rhs" or cls == "free_rhs":
        nr = max(nr, 1)
    batch = [next(letters) for _ in range(nb)]
    contract = [next(letters) for _ in range(nc)]
    lfree = [next(letters) for _ in range(nl)]
    rfree = [next(letters) for _ in range(nr)]
    size = {c: int(rng.choice([1, 2, 3])) for c in batch + contract + lfree + rfree}
    spec: dict[str, dict[str, Any]] = {"lhs": {}, "rhs": {}, "out": {}}

    def places(c: str) -> list[str]:
        return [p for p, ls in (("lhs", batch + contract + lfree), ("rhs", batch + contract + rfree),
                                ("out", batch + lfree + rfree)) if c in ls]

    # the collective's letter L, its size a multiple of n (and of small factors for chunks)
    if kind == "all_gather":
        pool = {"batch": batch, "contracting": contract, "free": lfree if operand == "lhs" else rfree}[cls]
        L = str(rng.choice(pool))
        size[L] = n * int(rng.choice([1, 2, 4, 8]))
        spec[operand][L] = "x"
        # Megatron style: the other operand's own free letter (and the output's) also on x
        other_free = rfree if operand == "lhs" else lfree
        if other_free and rng.integers(0, 2):
            c = str(rng.choice(other_free))
            size[c] = n * int(rng.choice([1, 2]))
            for p_ in places(c):
                spec[p_][c] = "x"
        used = {L} | {c for p_ in spec.values() for c in p_}
    else:
        L = str(rng.choice({"batch": batch, "free_lhs": lfree, "free_rhs": rfree}[cls]))
        K = str(rng.choice(contract))
        size[L] = n * int(rng.choice([1, 2, 4, 8]))
        size[K] = n * int(rng.choice([1, 2, 3]))
        spec["out"][L] = "x"
        spec["lhs"][K] = spec["rhs"][K] = "x"
        used = {L, K}
    if second:
        cands = [c for c in batch + lfree + rfree if c not in used]
        if cands:
            c = str(rng.choice(cands))
            size[c] = 2 * int(rng.choice([1, 2]))
            for p_ in places(c):
                spec[p_][c] = "d"
        else:
            second = False

    def order(ls: list[str]) -> list[str]:
        return [ls[i] for i in rng.permutation(len(ls))]

    lhs, rhs = order(batch + contract + lfree), order(batch + contract + rfree)
    out = order(batch + lfree + rfree)
    if not lhs or not rhs:  # an operand needs a letter; give it a contracting one of size 1..2
        c = next(letters)
        size[c] = int(rng.choice([1, 2]))
        lhs.append(c)
        rhs.append(c)
    mesh = {"x": n, "d": 2} if second else {"x": n}
    d = {
        "equation": f"{''.join(lhs)},{''.join(rhs)}->{''.join(out)}",
        "lhs": {"shape": [size[c] for c in lhs], "spec": [spec["lhs"].get(c) for c in lhs]},
        "rhs": {"shape": [size[c] for c in rhs], "spec": [spec["rhs"].get(c) for c in rhs]},
        "out_spec": [spec["out"].get(c) for c in out],
        "dtype": dtype,
        "mesh": mesh,
    }
    return Problem.from_dict(d)


def outputs_of(procs: list[Any], timeout: float) -> list[str]:
    """The end of each process's combined output (Popen with stdout=PIPE), waiting for all; if
    one outlives `timeout`, every process is killed and TimeoutExpired raised (a test's helper for
    the processes of one multi-process job)."""
    import subprocess

    outputs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outputs.append(out.decode(errors="replace")[-3000:])
    return outputs


@functools.cache
def netns_reason() -> str:
    """Why this machine cannot run a lab on shaped links (network namespaces: root and iproute2's
    `ip netns`), or '' when it can (a test's skip reason; lab:none works either way). Asked once
    per process."""
    import os
    import shutil
    import subprocess

    if os.geteuid() != 0:
        return f"network namespaces need root (running as uid {os.geteuid()})"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "`ip netns` is not available"
    return ""

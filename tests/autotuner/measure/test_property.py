"""Property test (issue 14 item 1): random sharded einsums of every shape extraction can emit, and every
strategy of their space, run through the path `tune` uses on inproc targets (a LocalRunner on a
mesh as `TargetSession.runner` builds it, `run_session`: compile, check against the baseline, time,
and the collective and the einsum alone), each program's result checked against the plain einsum.

Drawn: all-gather of either operand along a free, batch or contracting letter, or reduce-scatter
along a free or batch output letter; 0-2 letters of every class (so rank-changing outputs, several
contracting dims, batch dims); a second mesh axis `data`, either on another letter or as the major
axis of the collective letter's own entry (an operand sharded on two mesh axes); float32 or bfloat16.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autotuner import Problem, space
from autotuner.measure import LocalRunner, run_session
from autotuner.testing import TOLERANCE, inputs, reference

M = "model"


@st.composite
def sharded_einsums(draw: Any) -> Problem:
    kind = draw(st.sampled_from(["all_gather", "reduce_scatter"]))
    n = draw(st.sampled_from([1, 2, 3, 4]))
    dsize = draw(st.sampled_from([1, 2])) if n <= 4 else 1
    data_on = draw(st.sampled_from(["none", "other", "same"]))   # where the data axis goes
    nb, nc, nl, nr = (draw(st.integers(0, 2)) for _ in range(4))
    if kind == "all_gather":
        operand = draw(st.sampled_from(["lhs", "rhs"]))
        cls = draw(st.sampled_from(["free", "batch", "contracting"]))
    else:
        operand, cls = None, draw(st.sampled_from(["free_lhs", "free_rhs", "batch"]))
        nc = max(nc, 1)
    nb = max(nb, 1) if cls == "batch" else nb
    nc = max(nc, 1) if cls == "contracting" else nc
    nl = max(nl, 1) if cls in ("free_lhs",) or (cls == "free" and operand == "lhs") else nl
    nr = max(nr, 1) if cls in ("free_rhs",) or (cls == "free" and operand == "rhs") else nr
    letters = iter("abcdefghijklmnop")
    batch, contract = [next(letters) for _ in range(nb)], [next(letters) for _ in range(nc)]
    lfree, rfree = [next(letters) for _ in range(nl)], [next(letters) for _ in range(nr)]
    size = {c: draw(st.sampled_from([1, 2, 3])) for c in batch + contract + lfree + rfree}
    spec: dict[str, dict[str, tuple[str, ...]]] = {"lhs": {}, "rhs": {}, "out": {}}
    homes = {"lhs": batch + contract + lfree, "rhs": batch + contract + rfree, "out": batch + lfree + rfree}

    def put(c: str, entry: tuple[str, ...], only: str | None = None) -> None:
        for place, ls in homes.items():
            if c in ls and (only is None or place == only):
                spec[place][c] = entry

    if kind == "all_gather":
        pool = {"batch": batch, "contracting": contract, "free": lfree if operand == "lhs" else rfree}[cls]
        L = draw(st.sampled_from(pool))
        size[L] = n * draw(st.sampled_from([1, 2, 4]))
        two = data_on == "same" and cls != "contracting" and dsize > 1
        if two:                       # (data, model) on the gathered operand, data alone elsewhere
            size[L] *= dsize
            put(L, ("data",))
        spec[operand][L] = ("data", M) if two else (M,)
        other = rfree if operand == "lhs" else lfree
        if other and draw(st.booleans()):   # Megatron: the other operand's free letter on model too
            c = draw(st.sampled_from(other))
            size[c] = n * draw(st.sampled_from([1, 2]))
            put(c, (M,))
        used = {c for p in spec.values() for c in p}
    else:
        L = draw(st.sampled_from({"batch": batch, "free_lhs": lfree, "free_rhs": rfree}[cls]))
        K = draw(st.sampled_from(contract))
        size[L], size[K] = n * draw(st.sampled_from([1, 2, 4])), n * draw(st.sampled_from([1, 2]))
        two = data_on == "same" and dsize > 1
        if two:
            size[L] *= dsize
            put(L, ("data",))
        spec["out"][L] = ("data", M) if two else (M,)
        spec["lhs"][K] = spec["rhs"][K] = (M,)
        used = {L, K}
    if data_on == "other" and dsize > 1:
        free = [c for c in batch + lfree + rfree if c not in used]
        if free:
            c = draw(st.sampled_from(free))
            size[c] = dsize * draw(st.sampled_from([1, 2]))
            put(c, ("data",))
    lhs = draw(st.permutations(homes["lhs"])) or []
    rhs = draw(st.permutations(homes["rhs"])) or []
    out = draw(st.permutations(homes["out"]))
    if not lhs or not rhs:           # an operand needs a letter: a small unsharded contracting one
        c = next(letters)
        size[c] = draw(st.sampled_from([1, 2]))
        lhs, rhs = [*lhs, c], [*rhs, c]

    def entries(place: str, ls: list[str]) -> list[Any]:
        return [list(spec[place][c]) if c in spec[place] else None for c in ls]

    return Problem.from_dict({
        "equation": f"{''.join(lhs)},{''.join(rhs)}->{''.join(out)}",
        "lhs": {"shape": [size[c] for c in lhs], "spec": entries("lhs", lhs)},
        "rhs": {"shape": [size[c] for c in rhs], "spec": entries("rhs", rhs)},
        "out_spec": entries("out", out),
        "dtype": draw(st.sampled_from(["float32", "bfloat16"])),
        "mesh": {"data": dsize, M: n},
    })


def check(problem: Problem, strategies: list) -> None:
    """Run `strategies` as `tune` does and check every compiled program against the plain einsum."""
    assert problem.pattern.kind in ("all_gather", "reduce_scatter")
    shape = tuple(s for _, s in problem.mesh)
    mesh = jax.make_mesh(shape, tuple(a for a, _ in problem.mesh), devices=jax.devices()[: math.prod(shape)])
    runner = LocalRunner(mesh, warmup=0)
    result = run_session(runner, problem, strategies, reps=1)
    failed = {c.key: c.reason for c in [result.baseline, *result.candidates] if c.status != "ok"}
    assert failed == {}, f"{problem.to_dict()}: {failed}"
    assert result.comm_s is not None and result.comp_s is not None and result.bound_s is not None
    want = reference(problem, *inputs(problem, runner.seed))
    scale = max(float(np.max(np.abs(want))), 1e-30)
    for i, s in enumerate(strategies):
        fn, args = runner.programs[i]
        got = np.asarray(fn(*args), np.float64)
        assert got.shape == want.shape, (s.key, got.shape, want.shape)
        err = float(np.max(np.abs(got - want))) / scale
        assert err <= 2 * TOLERANCE[problem.dtype], f"{s.key}: relative error {err:.3g} on {problem.to_dict()}"


@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(problem=sharded_einsums(), data=st.data())
def test_random_einsums_tune_correctly_with_a_sample_of_their_space(problem: Problem, data: Any) -> None:
    full = space(problem)
    picked = data.draw(st.lists(st.sampled_from(full[1:]), max_size=3, unique=True)) if len(full) > 1 else []
    check(problem, [full[0], *picked])


@pytest.mark.slow
@settings(max_examples=6, deadline=None, derandomize=True,   # tests/autotuner/decompose walks every space too
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(problem=sharded_einsums())
def test_random_einsums_tune_correctly_with_every_strategy(problem: Problem) -> None:
    check(problem, space(problem))


# The layouts the real models produce (tests/models): Q/K/V and gate/up projections gather a rank-3
# activation into a rank-4 (heads) or rank-3 output, weight-gradient-like dots contract two letters,
# and the data axis shards the batch; one operand sharded over (data, model).
REAL = [
    ("abc,cde->abde", [2, 32, 64], ["data", M, None], [64, 4, 8], [None, M, None], ["data", None, M, None]),
    ("abc,dec->abde", [2, 32, 64], ["data", M, None], [4, 8, 64], [M, None, None], ["data", None, M, None]),
    ("abde,dec->abc", [2, 32, 4, 8], ["data", None, M, None], [4, 8, 64], [M, None, None], ["data", M, None]),
    ("abc,cd->abd", [2, 32, 64], [None, ["data", M], None], [64, 16], [None, M], [None, "data", M]),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", REAL, ids=[r[0] for r in REAL])
def test_real_model_layouts(case: tuple, dtype: str) -> None:
    eq, ls, lsp, rs, rsp, osp = case
    p = Problem.from_dict({"equation": eq, "lhs": {"shape": ls, "spec": lsp}, "rhs": {"shape": rs, "spec": rsp},
                           "out_spec": osp, "dtype": dtype, "mesh": {"data": 2, M: 2}})
    full = space(p)
    check(p, full if dtype == "float32" else full[:4])

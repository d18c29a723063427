"""`build_keeping`: the ring of an all-gather problem or group that also returns the gathered
operand (for a program that reuses the gathered value, e.g. a weight gradient). Every ring of the
space, on random groups (every class, side and ring size of `random_group`) and on each group's
first member alone: the einsums as `jnp.einsum` gives them, the gathered operand bit for bit."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import autotuner
from autotuner import GroupedProblem, Strategy, StrategyError
from autotuner.decompose import build_keeping
from autotuner.decompose.canonical import canonical
from autotuner.testing import TOLERANCE, group_inputs, group_reference, random_group, relative_error

from .test_grouped import make_mesh


def check(unit: autotuner.Problem | GroupedProblem, gp: GroupedProblem, x: np.ndarray,
          ws: list[np.ndarray], refs: list[np.ndarray]) -> int:
    mesh = make_mesh(gp)
    rings = [s for s in autotuner.space(unit) if s.method == "ring"]
    fns = [build_keeping(unit, s, mesh) for s in rings]
    outs = jax.jit(lambda *a: [f(*a) for f in fns])(x, *ws)
    for s, out in zip(rings, outs, strict=True):
        *results, gathered = out
        assert len(results) == len(ws), s.key
        np.testing.assert_array_equal(np.asarray(gathered), np.asarray(x), err_msg=s.key)
        for r, ref in zip(results, refs, strict=True):
            err = relative_error(r, ref)
            assert err <= TOLERANCE[gp.dtype], f"{s.key}: relative error {err:.3g}"
    return len(rings)


@pytest.mark.parametrize("seed", range(6))
def test_every_ring_keeps_the_gathered_operand(seed: int) -> None:
    gp = random_group(np.random.default_rng(2000 + seed), n=seed % 4 + 2)
    x, *ws = group_inputs(gp, seed=3)
    refs = group_reference(gp, x, *ws)
    assert check(gp, gp, x, ws, refs) > 0
    check(gp.members[0], gp, x, ws[:1], refs[:1])


def test_only_rings_over_an_all_gather_keep() -> None:
    gp = random_group(np.random.default_rng(2000), n=2)
    mesh = make_mesh(gp)
    with pytest.raises(StrategyError):
        build_keeping(gp, Strategy.baseline(), mesh)


@pytest.mark.parametrize("eq", ["bsd,df->bsf", "bsd,dhk->bshk", "df,bsd->bsf"])
def test_a_kept_3d_problem_matches_einsum_and_keeps_its_operand(eq: str) -> None:
    """Single problems keep on their canonical matmul (size-1 letters dropped, letters that
    travel together merged): results and gathered operand reshaped back exactly."""
    from autotuner.testing import inputs, reference

    n = 4
    x = {"shape": [1, 16 * n, 32], "spec": [None, "x", None]}
    w = {"bsd,df->bsf": {"shape": [32, 8 * n], "spec": [None, "x"]},
         "bsd,dhk->bshk": {"shape": [32, 2 * n, 4], "spec": [None, "x", None]},
         "df,bsd->bsf": {"shape": [32, 8 * n], "spec": [None, "x"]}}[eq]
    out = {"bsd,df->bsf": [None, None, "x"], "bsd,dhk->bshk": [None, None, "x", None],
           "df,bsd->bsf": [None, None, "x"]}[eq]
    lhs, rhs = (w, x) if eq.startswith("df") else (x, w)
    p = autotuner.Problem.from_dict({"equation": eq, "lhs": lhs, "rhs": rhs, "out_spec": out,
                                     "dtype": "float32", "mesh": {"x": n}})
    assert canonical(p) is not None
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices")
    mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
    a, b = inputs(p, seed=5)
    ref = reference(p, a, b)
    xv = b if eq.startswith("df") else a
    wv = a if eq.startswith("df") else b
    rings = [s for s in autotuner.space(p) if s.method == "ring"]
    fns = [build_keeping(p, s, mesh) for s in rings]
    outs = jax.jit(lambda *args: [f(*args) for f in fns])(xv, wv)
    for s, (res, gathered) in zip(rings, outs, strict=True):
        np.testing.assert_array_equal(np.asarray(gathered), np.asarray(xv), err_msg=s.key)
        assert res.shape == p.out_shape, s.key
        err = relative_error(np.asarray(res), ref)
        assert err <= TOLERANCE[p.dtype], f"{s.key}: relative error {err:.3g}"

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
from autotuner.strategies import build_keeping
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

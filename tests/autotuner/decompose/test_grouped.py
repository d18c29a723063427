"""Grouped problems (one all-gather feeding k einsums): every strategy of `space` computes the k
einsums, each sharded as its `out_spec`, checked against float64 `einsum`s of the same inputs."""

from __future__ import annotations

import collections

import jax
import numpy as np
import pytest
from jax.extend.core import Jaxpr
from jax.sharding import NamedSharding

import autotuner
from autotuner import GroupedProblem, Strategy, StrategyError
from autotuner.decompose._common import pspec
from autotuner.testing import TOLERANCE, group_inputs, group_reference, random_group, relative_error


def make_mesh(gp: GroupedProblem) -> jax.sharding.Mesh:
    shape = tuple(s for _, s in gp.mesh)
    n = int(np.prod(shape))
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices, have {jax.device_count()}")
    return jax.make_mesh(shape, tuple(a for a, _ in gp.mesh), devices=jax.devices()[:n])


def check_all(gp: GroupedProblem, strategies: list[Strategy], group: int = 12) -> None:
    mesh = make_mesh(gp)
    args = group_inputs(gp, seed=1)
    refs = group_reference(gp, *args)
    for g in range(0, len(strategies), group):
        chunk = strategies[g: g + group]
        fns = [autotuner.build(gp, s, mesh) for s in chunk]
        outs = jax.jit(lambda *a, fns=fns: [f(*a) for f in fns])(*args)
        for s, out in zip(chunk, outs, strict=True):
            assert isinstance(out, tuple) and len(out) == gp.k, s.key
            for m, o, ref in zip(gp.members, out, refs, strict=True):
                assert o.shape == m.out_shape, (s.key, m.describe())
                assert str(o.dtype) == gp.dtype, (s.key, m.describe())
                err = relative_error(o, ref)
                assert err <= TOLERANCE[gp.dtype], f"{s.key} on {m.describe()}: relative error {err:.3g}"
                want = NamedSharding(mesh, pspec(m.out_spec))
                assert o.sharding.is_equivalent_to(want, len(m.out_shape)), (s.key, o.sharding, want)


SEEDS = list(range(10))


@pytest.mark.parametrize("seed", SEEDS)
def test_random_group_every_strategy(seed: int) -> None:
    rng = np.random.default_rng(1000 + seed)
    gp = random_group(rng, n=seed % 8 + 1)
    check_all(gp, autotuner.space(gp))


def test_a_groups_serial_controls_match_einsum() -> None:
    """The serial controls (`Strategy.serial`) of a group's rings, one way and both ways, compute
    its einsums (the ring driver is the single problem's, whose controls test_strategies checks
    on every seed)."""
    gp = random_group(np.random.default_rng(1006), n=7)
    rings = [s for s in autotuner.space(gp) if s.method == "ring" and s.unroll == "full" and s.chunks == 1]
    controls = [next(s for s in rings if s.direction == d).serial() for d in ("uni", "bidi")]
    check_all(gp, controls)


def test_generator_covers_classes_sides_and_sizes() -> None:
    seen = collections.defaultdict(set)
    for seed in SEEDS:
        gp = random_group(np.random.default_rng(1000 + seed), n=seed % 8 + 1)
        seen["class"].add(gp.pattern.dim_class)
        seen["n"].add(gp.axis_size)
        seen["k"].add(gp.k)
        seen["mixed"].add(len({m.pattern.operand for m in gp.members}) > 1)
        seen["bidi"].add(any(s.direction == "bidi" for s in autotuner.space(gp)))
    assert seen["class"] == {"free", "batch", "contracting"}
    assert seen["n"] == set(range(1, 9))
    assert seen["k"] == {2, 3}
    assert seen["mixed"] == {True, False}
    assert seen["bidi"] == {True, False}


def test_space_is_the_members_common_space() -> None:
    """Every ring of the group's space suits each member; the knobs of a single ring all appear."""
    gp = random_group(np.random.default_rng(7), n=4, k=2, dtype="float32")
    got = autotuner.space(gp)
    assert got[0].is_baseline
    for s in got[1:]:
        for m in gp.members:
            assert s in autotuner.space(m)
    assert {s.direction for s in got[1:]} == {"uni", "bidi"}
    assert {s.fuse for s in got[1:]} == {"loop", "after"}


def test_a_strategy_a_member_cannot_run_is_refused() -> None:
    gp = autotuner.GroupedProblem.from_dict({"einsums": [
        {"equation": "sd,df->sf", "lhs": {"shape": [8, 4], "spec": ["x", None]},
         "rhs": {"shape": [4, 6], "spec": [None, None]}, "dtype": "float32", "mesh": {"x": 2}},
        {"equation": "de,sd->se", "lhs": {"shape": [4, 3], "spec": [None, None]},
         "rhs": {"shape": [8, 4], "spec": ["x", None]}, "dtype": "float32", "mesh": {"x": 2}},
    ]})
    with pytest.raises(StrategyError, match="direction"):
        autotuner.build(gp, Strategy("ring", "bidi"), make_mesh(gp))


def _eqns(jaxpr: Jaxpr):
    """Every equation of `jaxpr` and of the jaxprs its equations hold (shard_map's body)."""
    for e in jaxpr.eqns:
        yield e
        for v in e.params.values():
            inner = getattr(v, "jaxpr", v)
            if isinstance(inner, Jaxpr):
                yield from _eqns(inner)


@pytest.mark.parametrize("seed", range(3))
def test_a_grouped_ring_computes_each_block_start_once(seed: int) -> None:
    """Every member of a grouped ring, and each step's partial einsums and its write into the
    output, start at the same element offsets: each is computed once per ring (`Block`), and the
    other device's block on a ring of two is one subtraction, not a wrap-around select. The
    rewritten program's compile time grows with its instruction count (README, "Compile time")."""
    gp = random_group(np.random.default_rng(2000 + seed), n=2, k=3, dtype="float32")
    s = next(s for s in autotuner.space(gp)
             if s.method == "ring" and s.fuse == "loop" and s.unroll == "full" and s.chunks == 1)
    fn = autotuner.build(gp, s, make_mesh(gp))
    eqns = list(_eqns(jax.make_jaxpr(fn)(*group_inputs(gp, seed=1)).jaxpr))
    starts = [e for e in eqns if e.primitive.name == "mul" and e.outvars[0].aval.shape == ()
              and np.issubdtype(e.outvars[0].aval.dtype, np.integer)]
    assert len(starts) == 2, (gp.pattern.dim_class, [str(e) for e in starts])   # blocks i and 1 - i
    assert not [e for e in eqns if e.primitive.name == "select_n"]

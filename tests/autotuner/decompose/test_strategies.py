"""Every strategy that `space` returns computes the einsum, sharded as `out_spec`.

Runs on 8 in-process CPU devices (tests/conftest.py sets XLA_FLAGS). Problems come from a seeded
generator; each one is checked with every strategy in its space, compiled in groups to keep the
compile count (the cost of this file) down.
"""

from __future__ import annotations

import collections

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

import autotuner
from autotuner import Problem, Strategy, StrategyError
from autotuner.decompose._common import pspec
from autotuner.testing import TOLERANCE, inputs, random_problem, reference, relative_error


def skip_if_not_enough_devices(n: int) -> None:
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices, have {jax.device_count()}")


def make_mesh(p: Problem) -> jax.sharding.Mesh:
    shape = tuple(s for _, s in p.mesh)
    skip_if_not_enough_devices(int(np.prod(shape)))
    return jax.make_mesh(shape, tuple(a for a, _ in p.mesh), devices=jax.devices()[: int(np.prod(shape))])


def check_all(p: Problem, strategies: list[Strategy], group: int = 16) -> None:
    mesh = make_mesh(p)
    a, b = inputs(p, seed=1)
    ref = reference(p, a, b)
    want = NamedSharding(mesh, pspec(p.out_spec))
    for g in range(0, len(strategies), group):
        chunk = strategies[g: g + group]
        fns = [autotuner.build(p, s, mesh) for s in chunk]
        outs = jax.jit(lambda x, y, fns=fns: [f(x, y) for f in fns])(a, b)
        for s, out in zip(chunk, outs, strict=True):
            assert out.shape == p.out_shape, (s.key, p.describe())
            assert str(out.dtype) == p.dtype, (s.key, p.describe())
            err = relative_error(out, ref)
            assert err <= TOLERANCE[p.dtype], f"{s.key} on {p.describe()}: relative error {err:.3g}"
            assert out.sharding.is_equivalent_to(want, len(p.out_shape)), (s.key, out.sharding, want)


SEEDS = list(range(36))


@pytest.mark.parametrize("seed", SEEDS)
def test_random_problem_every_strategy(seed):
    rng = np.random.default_rng(seed)
    # walk the mesh sizes 1..8 and both patterns deterministically; the rest is random
    kind = ("all_gather", "reduce_scatter")[seed % 2]
    n = seed // 2 % 8 + 1
    p = random_problem(rng, kind=kind, n=n)
    every = autotuner.space(p)
    # each ring's serial control (decomposed, not overlapped) computes the same einsum; the fully
    # unrolled rings' controls cover direction, chunks and send_first, fuse alternating by seed
    controls = [s.serial() for s in every if s.method == "ring" and s.unroll == "full"
                and s.fuse == ("loop", "after")[seed // 2 % 2]] if seed % 3 == 0 else []   # 12 seeds: both kinds, n 1-8
    check_all(p, every + controls)


def test_generator_covers_the_acceptance_matrix():
    """The seeds above cover every pattern class, both operands, sizes 1-8, two axes, dtypes."""
    seen = collections.defaultdict(set)
    for seed in SEEDS:
        rng = np.random.default_rng(seed)
        p = random_problem(rng, kind=("all_gather", "reduce_scatter")[seed % 2], n=seed // 2 % 8 + 1)
        seen["label"].add(p.pattern.label)
        seen["n"].add(p.axis_size)
        seen["dtype"].add(p.dtype)
        seen["axes"].add(len(p.mesh))
        seen["multi"].add(len(p.eq.contracting) > 1 or len(p.eq.lhs_free) > 1 or len(p.eq.rhs_free) > 1)
    assert {"all_gather:lhs:free", "all_gather:rhs:free", "all_gather:lhs:contracting",
            "all_gather:rhs:contracting", "all_gather:lhs:batch", "reduce_scatter:free_lhs",
            "reduce_scatter:free_rhs", "reduce_scatter:batch"} <= seen["label"]
    assert seen["n"] == set(range(1, 9))
    assert {"float32", "bfloat16"} <= seen["dtype"]
    assert seen["axes"] == {1, 2}
    assert True in seen["multi"]


DESIGN = {"equation": "bsd,df->bsf",
          "lhs": {"shape": [2, 48, 16], "spec": [None, "x", None]},
          "rhs": {"shape": [16, 24], "spec": [None, "x"]},
          "out_spec": [None, None, "x"], "dtype": "bfloat16", "mesh": {"x": 6}}


def test_design_example_shape_every_strategy_bf16():
    p = Problem.from_dict(DESIGN)
    space = autotuner.space(p)
    assert space[0].is_baseline
    keys = {s.key for s in space}
    assert len(keys) == len(space)
    # every knob value appears
    assert {s.direction for s in space[1:]} == {"uni", "bidi"}
    assert {s.chunks for s in space[1:]} == {1, 2, 4}
    assert {s.unroll for s in space[1:]} == {1, 2, "full"}
    assert {s.fuse for s in space[1:]} == {"loop", "after"}
    check_all(p, space)


@pytest.mark.parametrize("n", [3, 5, 6, 7, 8])
def test_megatron_mlp_down_reduce_scatter(n):
    """Einsum -> ReduceScatter over the sequence, with a data axis on the batch when it fits."""
    two = n * 2 <= 8
    d = {"equation": "bsf,fd->bsd",
         "lhs": {"shape": [4, 8 * n, 4 * n], "spec": ["data" if two else None, None, "model"]},
         "rhs": {"shape": [4 * n, 8], "spec": ["model", None]},
         "out_spec": ["data" if two else None, "model", None], "dtype": "float32",
         "mesh": {"data": 2, "model": n} if two else {"model": n}}
    p = Problem.from_dict(d)
    assert p.pattern.label == "reduce_scatter:free_lhs"
    check_all(p, autotuner.space(p))


def test_ring_builds_for_a_single_device_axis():
    """space() offers only the baseline at n=1, but the ring program itself is still correct."""
    rng = np.random.default_rng(7)
    for kind in ("all_gather", "reduce_scatter"):
        p = random_problem(rng, kind=kind, n=1, second_axis=False)
        assert autotuner.space(p) == [Strategy.baseline()]
        check_all(p, [Strategy("ring", "uni", 1, "full", "loop", True),
                      Strategy("ring", "uni", 1, "full", "loop", False)])


def test_space_leaves_out_invalid_combinations():
    p = Problem.from_dict(dict(DESIGN, mesh={"x": 2}, lhs={"shape": [2, 4, 16], "spec": [None, "x", None]}))
    space = autotuner.space(p)
    assert all(s.direction == "uni" for s in space[1:])          # bidi needs n >= 3
    assert all(s.chunks in (1, 2) for s in space[1:])           # block of 2 rows: no 4 chunks
    assert all(s.unroll == "full" for s in space[1:])           # one loop iteration
    with pytest.raises(StrategyError, match="bidirectional"):
        autotuner.build(p, Strategy("ring", "bidi"), make_mesh(p))


def test_local_problem_only_baseline_and_mesh_mismatch():
    d = {"equation": "ij,jk->ik", "lhs": {"shape": [8, 8], "spec": ["x", None]},
         "rhs": {"shape": [8, 8], "spec": [None, None]}, "out_spec": ["x", None],
         "dtype": "float32", "mesh": {"x": 4}}
    p = Problem.from_dict(d)
    assert autotuner.space(p) == [Strategy.baseline()]
    check_all(p, [Strategy.baseline()])
    with pytest.raises(autotuner.ProblemError, match="mesh"):
        autotuner.build(p, Strategy.baseline(), jax.make_mesh((2,), ("x",), devices=jax.devices()[:2]))


def test_build_is_jittable_inside_a_larger_program():
    p = Problem.from_dict(dict(DESIGN, dtype="float32"))
    mesh = make_mesh(p)
    f = autotuner.build(p, [s for s in autotuner.space(p) if s.method == "ring"][-1], mesh)
    a, b = inputs(p)

    @jax.jit
    def prog(x, y):
        return (f(x * 2, y) + 1.0).sum()

    assert abs(float(prog(a, b)) - float((reference(p, a * 2, b) + 1.0).sum())) < 1e-3 * abs(
        float((reference(p, a * 2, b) + 1.0).sum())) + 1e-3



def run_parts(p: Problem) -> dict:
    """The harness's two halves (collective alone, einsum alone) compiled and run through the
    in-process harness exactly as `tune` does; returns the results of one run of each."""
    from autotuner.measure.local import LocalRunner
    from autotuner.measure.session import COMM, COMP

    session = LocalRunner(make_mesh(p), warmup=1)
    statuses = session.prepare(p, [Strategy("baseline")])
    assert statuses[0].get("reason") is None, statuses[0]
    return {k: jax.block_until_ready(session.programs[k][0](*session.programs[k][1])) for k in (COMM, COMP)}


@pytest.mark.parametrize("seed", SEEDS[:16])
def test_harness_parts_run_for_every_problem_shape(seed):
    """The parts build and run for the problems extraction emits, rank-changing ones included:
    the collective alone returns the gathered operand (its rank, not the einsum output's) or the
    scattered result."""
    from autotuner.measure.session import COMM

    rng = np.random.default_rng(1000 + seed)
    p = random_problem(rng, kind=("all_gather", "reduce_scatter")[seed % 2], n=seed // 2 % 4 + 2)
    got = run_parts(p)[COMM]
    if p.pattern.kind == "all_gather":
        gathered = p.lhs if p.pattern.operand == "lhs" else p.rhs
        assert got.shape == tuple(gathered.shape), p.describe()
    else:
        assert got.shape == p.out_shape, p.describe()


def test_harness_parts_of_a_rank_changing_all_gather():
    """The QKV projection of a sequence-parallel Llama: [b, s/x, d] gathered on s, then
    `abc,cde->abde` (3-D in, 4-D out). The collective alone once crashed the harness (issue 14)."""
    from autotuner.measure.session import COMM

    p = Problem.from_dict({"equation": "abc,cde->abde",
                           "lhs": {"shape": [2, 16, 8], "spec": [None, "x", None]},
                           "rhs": {"shape": [8, 4, 6], "spec": [None, None, None]},
                           "out_spec": [None, None, None, None], "dtype": "float32", "mesh": {"x": 4}})
    assert run_parts(p)[COMM].shape == (2, 16, 8)
    check_all(p, autotuner.space(p))

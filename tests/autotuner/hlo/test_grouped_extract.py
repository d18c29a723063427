"""Extraction groups the dots of one all-gather: a sequence-sharded activation gathered once for
three projections is one GroupedProblem (count 1 per call, times the scan's trips), whose build
on the model's operands gives the model's three einsums; a gather feeding one dot stays single."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import autotuner
from autotuner import GroupedProblem, Problem, Strategy
from autotuner.hlo import extract_report

S, D, H, F = 64, 32, 8, 16


def mesh4() -> jax.sharding.Mesh:
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices")
    return jax.make_mesh((4,), ("m",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])


def operands(mesh: jax.sharding.Mesh, layers: int | None = None):
    rng = np.random.default_rng(0)
    lead = () if layers is None else (layers,)
    x = jax.device_put(rng.standard_normal((S, D)).astype(np.float32), NamedSharding(mesh, P("m", None)))
    w_shapes = [(D, H), (D, H), (D, 2 * H)]
    ws = [jax.device_put(rng.standard_normal(lead + s).astype(np.float32),
                         NamedSharding(mesh, P(*([None] * len(lead)), None, "m"))) for s in w_shapes]
    return x, ws


def qkv(mesh: jax.sharding.Mesh):
    def f(x, wq, wk, wv):
        out = NamedSharding(mesh, P(None, "m"))
        q, k, v = (jax.lax.with_sharding_constraint(jnp.einsum("sd,dh->sh", x, w), out) for w in (wq, wk, wv))
        return q, k, v
    return f


def test_one_gather_three_dots_is_one_grouped_problem() -> None:
    mesh = mesh4()
    x, ws = operands(mesh)
    f = qkv(mesh)
    report = extract_report(f, x, *ws)
    assert report.pairs == 3
    [(gp, count)] = report.problems
    assert isinstance(gp, GroupedProblem) and count == 1
    assert gp.pattern.label == "all_gather_group3:free" and gp.pattern.axis == "m"
    assert [m.rhs.shape for m in gp.members] == [(D, H), (D, H), (D, 2 * H)]
    # the grouped ring on the model's own operands gives the model's results
    want = jax.jit(f)(x, *ws)
    for s in (Strategy.baseline(), *[s for s in autotuner.space(gp) if s.method == "ring"][:4]):
        got = jax.jit(autotuner.build(gp, s, mesh))(x, *ws)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5, err_msg=s.key)


def test_scanned_layers_count_the_trips() -> None:
    mesh = mesh4()
    x, ws = operands(mesh, layers=3)
    inner = qkv(mesh)

    def f(x, wq, wk, wv):
        def layer(h, w):
            q, k, v = inner(h, *w)
            r = q + k + v[:, :H] * v[:, H:]
            return h + jnp.tile(r, (1, D // H)), None
        h, _ = jax.lax.scan(layer, x, (wq, wk, wv))
        return h

    report = extract_report(f, x, *ws)
    groups = [(p.k, c) for p, c in report.problems if isinstance(p, GroupedProblem)]
    assert groups == [(3, 3)]


def test_a_gather_feeding_one_dot_stays_single() -> None:
    mesh = mesh4()
    x, ws = operands(mesh)
    f = lambda x, w: jax.lax.with_sharding_constraint(  # noqa: E731
        jnp.einsum("sd,dh->sh", x, w), NamedSharding(mesh, P(None, "m")))
    [(p, count)] = extract_report(f, x, ws[0]).problems
    assert isinstance(p, Problem) and count == 1 and p.pattern.label == "all_gather:lhs:free"

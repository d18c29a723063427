"""A dot whose operands XLA's HLO has in the other order than the traced equation.

XLA:TPU reorders the operands of some dots before its partitioner (the backward dots of penzai's
Llama step: 24 of its 42 pairs on `aot:tpu:v5e:4x2`), so the Problem read from its HLO is the
traced dot with lhs and rhs exchanged and its output in that order. The pass decomposes such a
dot as that Problem, its operands exchanged and the result transposed back
(`overlap.find.swapped_view`, `overlap.apply.traced_order`). XLA:CPU keeps the traced order, so
here its HLO is read as XLA:TPU's would be: every Problem found is swapped (`match_dot` wrapped).
Each rewrite must equal plain jit, for an all-gather feeding the dot and a reduce-scatter taking
its result, for every ring of the pair's space. Where the dot's layouts are explicit the pass
leaves it plain, and says why.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from autotuner import Problem, space
from autotuner.overlap import find, overlap
from autotuner.testing import TOLERANCE, relative_error


def swapped(p: Problem) -> Problem:
    """`p` with its operands exchanged, the output in the exchanged dot's order (batch, then the
    new lhs's free letters, then the new rhs's)."""
    eq, d = p.eq, p.to_dict()
    batch = [c for c in eq.out if c in eq.lhs and c in eq.rhs]
    lfree = [c for c in eq.out if c in eq.lhs and c not in eq.rhs]
    rfree = [c for c in eq.out if c in eq.rhs and c not in eq.lhs]
    out = batch + rfree + lfree
    spec = dict(zip(eq.out, d["out_spec"], strict=True))
    return Problem.from_dict({**d, "equation": f"{eq.rhs},{eq.lhs}->{''.join(out)}", "lhs": d["rhs"],
                              "rhs": d["lhs"], "out_spec": [spec[c] for c in out]})


@pytest.fixture
def as_tpu_reads(monkeypatch: pytest.MonkeyPatch) -> list[Problem]:
    """Every Problem the pass reads from the HLO swapped; the list of those it read."""
    real, seen = find.match_dot, []

    def match(*a: Any, **k: Any) -> Any:
        got = real(*a, **k)
        if isinstance(got, Problem):
            got = swapped(got)
            seen.append(got)
        return got

    monkeypatch.setattr(find, "match_dot", match)
    return seen


def _mesh(kind: AxisType) -> Any:
    if jax.device_count() < 4:
        pytest.skip(f"needs 4 devices, have {jax.device_count()}")
    return jax.make_mesh((4,), ("x",), axis_types=(kind,), devices=jax.devices()[:4])


# (equation, lhs spec, rhs spec, out spec): sequence-parallel MLP up (the activation gathered into a
# free dimension), its down projection (the result reduce-scattered), and a weight gradient (the
# activation gathered into the contraction)
CASES = {
    "all-gather, free": ("sd,df->sf", P("x", None), P(None, "x"), P(None, "x")),
    "reduce-scatter": ("sf,fd->sd", P(None, "x"), P("x", None), P("x", None)),
    "all-gather, contracting": ("sf,sd->fd", P(None, "x"), P("x", None), P("x", None)),
}


def _case(name: str, mesh: Any) -> tuple[Any, tuple[Any, Any]]:
    eq, ls, rs, os_ = CASES[name]
    k1, k2 = jax.random.split(jax.random.key(0))
    a, b = eq.split("->")[0].split(",")
    size = {"s": 64, "d": 32, "f": 48}
    x = jax.device_put(jax.random.normal(k1, [size[c] for c in a]), NamedSharding(mesh, ls))
    w = jax.device_put(jax.random.normal(k2, [size[c] for c in b]), NamedSharding(mesh, rs))

    def fn(x: Any, w: Any) -> Any:
        return jax.lax.with_sharding_constraint(jnp.einsum(eq, x, w), NamedSharding(mesh, os_))

    return jax.jit(fn), (x, w)


@pytest.mark.parametrize("name", list(CASES))
def test_a_dot_whose_hlo_swaps_its_operands_is_decomposed_and_equals_plain_jit(name: str, as_tpu_reads: list) -> None:
    fn, args = _case(name, _mesh(AxisType.Auto))
    want = fn(*args)
    plan = overlap(fn, strategy="plain").plan(*args)
    assert len(plan) == 1 and as_tpu_reads, "\n" + str(plan)
    problem = as_tpu_reads[0]
    assert list(plan)[0].problem == problem and list(plan)[0].source != "unmapped", "\n" + str(plan)
    rings = [s for s in space(problem) if s.method == "ring"]
    assert rings
    for ring in rings:
        ov = overlap(fn, strategy=lambda p, ring=ring: ring, memory=None)
        got = ov.plan(*args)
        assert [r.applied for r in got] == [True], "\n" + str(got)
        err = relative_error(ov(*args), want)
        assert err <= TOLERANCE["float32"], (ring.key, err)


def test_with_explicit_layouts_a_swapped_dot_stays_plain_and_says_why(as_tpu_reads: list) -> None:
    mesh = _mesh(AxisType.Explicit)
    x = jax.device_put(jnp.ones((64, 32)), NamedSharding(mesh, P("x", None)))
    w = jax.device_put(jnp.ones((32, 48)), NamedSharding(mesh, P(None, "x")))
    fn = jax.jit(lambda x, w: jnp.einsum("sd,df->sf", x, w, out_sharding=NamedSharding(mesh, P(None, "x"))))
    plan = overlap(fn, strategy=lambda p: space(p)[1], memory=None).plan(x, w)
    assert as_tpu_reads and [r.applied for r in plan] == [False], "\n" + str(plan)
    assert list(plan)[0].source == "unmapped" and "operand shapes differ" in list(plan)[0].note
    assert relative_error(overlap(fn, strategy=lambda p: space(p)[1])(x, w), fn(x, w)) == 0.0


@pytest.mark.parametrize("shape", [(4,), (2, 2)])
def test_a_training_step_whose_every_dot_the_hlo_swaps_equals_plain_jit(shape: tuple[int, ...], as_tpu_reads: list) -> None:
    """The built-in example's training step on an Auto mesh (1-D model, 2-D data x model), every
    pair swapped: forward and backward dots are decomposed, rings that keep their gathered value
    for the weight gradients included (the other users take it as it is, in its own order)."""
    from .test_overlap import assert_close, program

    _, step, args = program("auto", shape)
    want = jax.jit(step)(*args)
    ov = overlap(step, strategy=lambda p: space(p)[1], memory=None)
    plan = ov.plan(*args)
    assert as_tpu_reads and sum(r.applied for r in plan) >= 11, "\n" + str(plan)
    assert any("keeps the gathered value" in (r.note or "") for r in plan if r.applied), "\n" + str(plan)
    assert not any(r.source == "unmapped" for r in plan if r.problem is not None), "\n" + str(plan)
    assert_close(ov(*args), want, "float32")

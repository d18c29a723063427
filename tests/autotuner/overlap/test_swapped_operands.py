"""A dot whose operands XLA's HLO has in the other order than the traced equation, or whose operand
it reads before a transpose that it folds into the dot (below).

XLA:TPU reorders the operands of some dots before its partitioner (the backward dots of penzai's
Llama step: 24 of its 42 pairs on `aot:tpu:v5e:4x2`), so the Problem read from its HLO is the
traced dot with lhs and rhs exchanged and its output in that order. The pass decomposes such a
dot as that Problem, its operands exchanged and the result transposed back
(`overlap.dotview`). XLA:CPU keeps the traced order, so
here its HLO is read as XLA:TPU's would be: every Problem found is swapped (`hlo.problems.match_dot` wrapped).
Each rewrite must equal plain jit, for an all-gather feeding the dot and a reduce-scatter taking
its result, with the first and the last ring of the pair's space (unidirectional unchunked,
bidirectional chunked and fused: the exchange and transposes around a ring are the same for every
ring, whose own numerics tests/autotuner/decompose checks). Where the dot's layouts are explicit
the pass leaves it plain, and says why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from autotuner import Problem, space
from autotuner.hlo import problems
from autotuner.overlap import overlap
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


def _reads_as(monkeypatch: pytest.MonkeyPatch, change: Callable[[Problem], Problem]) -> list[Problem]:
    """Every Problem read from the HLO (`hlo.problems.match_dot`, which extraction and the pass
    call) `change`d, as XLA:TPU's HLO would give it; the list of those read."""
    real, seen = problems.match_dot, []

    def match(*a: Any, **k: Any) -> Any:
        got = real(*a, **k)
        if isinstance(got, Problem):
            got = change(got)
            seen.append(got)
        return got

    monkeypatch.setattr(problems, "match_dot", match)
    return seen


@pytest.fixture
def as_tpu_reads(monkeypatch: pytest.MonkeyPatch) -> list[Problem]:
    """Every Problem the pass reads from the HLO swapped; the list of those it read."""
    return _reads_as(monkeypatch, swapped)


def _first_and_last_rings_equal_plain(fn: Any, args: tuple[Any, ...], problem: Problem) -> None:
    """The pair decomposed by the first and the last ring of its space, each equal to plain jit."""
    want = fn(*args)
    rings = [s for s in space(problem) if s.method == "ring"]
    assert rings
    for ring in (rings[0], rings[-1]):
        ov = overlap(fn, strategy=lambda p, ring=ring: ring, memory=None)
        got = ov.plan(*args)
        assert [r.applied for r in got] == [True], "\n" + str(got)
        err = relative_error(ov(*args), want)
        assert err <= TOLERANCE["float32"], (ring.key, err)


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
    plan = overlap(fn, strategy="plain").plan(*args)
    assert len(plan) == 1 and as_tpu_reads, "\n" + str(plan)
    problem = as_tpu_reads[0]
    assert list(plan)[0].problem == problem and list(plan)[0].source != "unmapped", "\n" + str(plan)
    _first_and_last_rings_equal_plain(fn, args, problem)


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


# -- a transpose folded into the dot ---------------------------------------------------------------
# XLA folds a `transpose` that gives a dot's operand into the dot (its dimension numbers read the
# transpose's input); XLA:TPU does so before its partitioner, so the Problem read from its HLO is
# the dot of the transpose's input: keras-hub's tied LM head `x @ table.T` on keras-hub's Gemma
# layout reads the table [vocab, hidden] itself (`aot:tpu:v5e:4x2`). XLA:CPU folds after its
# partitioner, so here the HLO is read as XLA:TPU's would be: the Problem found has the transpose's
# input in place of the operand (`folded`).

def folded(p: Problem, side: str, q: tuple[int, ...]) -> Problem:
    """`p` as the dot that reads `transpose`'s input in place of its `side` operand (the traced
    operand's dimension i is the input's dimension q[i]), its output in that dot's order."""
    eq, d = p.eq, p.to_dict()
    letters = eq.lhs if side == "lhs" else eq.rhs
    new, shape, spec = [""] * len(q), [0] * len(q), [None] * len(q)
    for i, j in enumerate(q):
        new[j], shape[j], spec[j] = letters[i], d[side]["shape"][i], d[side]["spec"][i]
    lhs, rhs = ("".join(new), eq.rhs) if side == "lhs" else (eq.lhs, "".join(new))
    batch = [c for c in eq.out if c in lhs and c in rhs]
    out = batch + [c for c in lhs if c not in rhs] + [c for c in rhs if c not in lhs]
    spec_of = dict(zip(eq.out, d["out_spec"], strict=True))
    return Problem.from_dict({**d, "equation": f"{lhs},{rhs}->{''.join(out)}", side: {"shape": shape, "spec": spec},
                              "out_spec": [spec_of[c] for c in out]})


# name: (traced equation, stored operands' specs, which operand the dot reads transposed and its
# permutation, the result's spec): the LM head (reduce-scatter, the table transposed), a
# sequence-parallel MLP up whose weight is stored [f, d], one whose gathered activation is a
# transpose of [b, s, d] (the result's order then differs from the folded dot's), and a batched
# dot whose per-batch weight is stored [b, d, f]
FOLDS = {
    "reduce-scatter, weight transposed": ("sf,fd->sd", P(None, "x"), P(None, "x"), "rhs", (1, 0), P("x", None)),
    "all-gather, weight transposed": ("sd,df->sf", P("x", None), P("x", None), "rhs", (1, 0), P(None, "x")),
    "all-gather, activation transposed": ("sbd,df->sbf", P(None, "x", None), P(None, "x"), "lhs", (1, 0, 2),
                                          P(None, None, "x")),
    "reduce-scatter, batched, weight transposed": ("bsf,bfd->bsd", P(None, None, "x"), P(None, None, "x"), "rhs",
                                                   (0, 2, 1), P(None, "x", None)),
}


def _folds(name: str, mesh: Any) -> tuple[Any, tuple[Any, Any]]:
    eq, ls, rs, side, q, os_ = FOLDS[name]
    size = {"s": 64, "d": 32, "f": 48, "b": 2}
    a, b = eq.split("->")[0].split(",")
    stored = lambda letters, t: [size[letters[q.index(j)]] if t else size[c] for j, c in enumerate(letters)]  # noqa: E731
    k1, k2 = jax.random.split(jax.random.key(1))
    x = jax.device_put(jax.random.normal(k1, stored(a, side == "lhs")), NamedSharding(mesh, ls))
    w = jax.device_put(jax.random.normal(k2, stored(b, side == "rhs")), NamedSharding(mesh, rs))

    def fn(x: Any, w: Any) -> Any:
        x, w = (jnp.transpose(x, q), w) if side == "lhs" else (x, jnp.transpose(w, q))
        return jax.lax.with_sharding_constraint(jnp.einsum(eq, x, w), NamedSharding(mesh, os_))

    return jax.jit(fn), (x, w)


def _reads_folded(monkeypatch: pytest.MonkeyPatch, side: str, q: tuple[int, ...], swap: bool = False) -> list[Problem]:
    """Every Problem the pass reads from the HLO `folded` (and swapped); the list of those it read."""
    return _reads_as(monkeypatch, lambda p: swapped(folded(p, side, q)) if swap else folded(p, side, q))


@pytest.mark.parametrize("swap", [False, True], ids=["folded", "folded and swapped"])
@pytest.mark.parametrize("name", list(FOLDS))
def test_a_dot_whose_hlo_folds_a_transpose_is_decomposed_and_equals_plain_jit(
        name: str, swap: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _reads_folded(monkeypatch, FOLDS[name][3], FOLDS[name][4], swap)
    fn, args = _folds(name, _mesh(AxisType.Auto))
    assert list(overlap(fn, strategy="plain").plan(*args))[0].problem == seen[0]
    _first_and_last_rings_equal_plain(fn, args, seen[0])


def test_a_gathered_transpose_with_other_users_is_decomposed_without_keeping_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ring keeps its gathered value for the gather's other users in the Problem's layout; where
    that is the input of a folded transpose, they read the transpose: the ring does not keep it
    (their gather stays), says so, and equals plain jit."""
    _reads_folded(monkeypatch, "lhs", (1, 0))
    mesh = _mesh(AxisType.Auto)
    x = jax.device_put(jax.random.normal(jax.random.key(2), (32, 64)), NamedSharding(mesh, P(None, "x")))
    w = jax.device_put(jax.random.normal(jax.random.key(3), (32, 48)), NamedSharding(mesh, P(None, "x")))

    def fn(x: Any, w: Any) -> Any:
        xt = jax.lax.with_sharding_constraint(x.T, NamedSharding(mesh, P("x", None)))
        y = jax.lax.with_sharding_constraint(xt @ w, NamedSharding(mesh, P(None, "x")))
        return y, jax.lax.with_sharding_constraint(jnp.tanh(xt), NamedSharding(mesh, P()))

    fn = jax.jit(fn)
    ov = overlap(fn, strategy=lambda p: space(p)[1], memory=None)
    plan = ov.plan(x, w)
    row = next(r for r in plan if r.problem is not None)
    assert row.applied and "in the layout of a transpose" in row.note and not row.kept_bytes, "\n" + str(plan)
    for got, want in zip(ov(x, w), fn(x, w), strict=True):
        assert relative_error(got, want) <= TOLERANCE["float32"]


def test_a_folded_transpose_is_not_looked_through_without_its_equation(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same Problem, where the traced operand is not a transpose (the weight stored as the
    dot reads it, no transpose in the trace): nothing says the HLO's operand is the traced one
    transposed, so the pair stays plain and says why."""
    _reads_folded(monkeypatch, "rhs", (1, 0))
    mesh = _mesh(AxisType.Auto)
    x = jax.device_put(jnp.ones((64, 48)), NamedSharding(mesh, P(None, "x")))
    w = jax.device_put(jnp.ones((48, 32)), NamedSharding(mesh, P("x", None)))
    fn = jax.jit(lambda x, w: jax.lax.with_sharding_constraint(x @ w, NamedSharding(mesh, P("x", None))))
    plan = overlap(fn, strategy=lambda p: space(p)[1], memory=None).plan(x, w)
    assert [r.applied for r in plan] == [False] and "operand shapes differ" in list(plan)[0].note, "\n" + str(plan)

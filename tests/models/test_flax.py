"""Extraction on a GPT made of Flax NNX's layers (tests/models/flax_gpt.py): the pairs counted by hand.

Counted from flax 0.12.8's code (site-packages/flax/nnx/nn/...), L = 2 blocks. Per block, the
attention's Q, K and V are `LinearGeneral`s (attention.py:666-668; one `lax.dot_general`, linear.py:298)
with kernels [hidden, heads, head_dim] (column-parallel: heads over model), its output a
`LinearGeneral` over axis (-2, -1) (attention.py:567, :767) whose kernel [heads, head_dim, hidden]
is row-parallel, so that one dot contracts heads and head_dim together; the MLP's up and down are
`nn.Linear`s (linear.py:422), column- and row-parallel. Attention scores and values are einsums
(attention.py:157, :324) with the heads local: no collective. LayerNorm has no dot; the LM head
(`Linear`, replicated) is one.

Tensor parallel only (batch over data, residual stream replicated over model):
- forward: the attention output and the MLP down contract the sharded heads / mlp, so their partial
  sums are all-reduced over model and used whole by the residual add: 2L, no decomposable pair.
- training step adds per block the input gradients of Q, K, V and up (they contract the sharded
  heads / mlp: 4 all-reduces over model) and the 6 kernels' weight gradients (they contract the
  data-sharded batch: 6 all-reduces over data), plus the LM head's weight gradient: 2L + 4L + 6L
  + 1 all-reduces used whole. The biases' gradients are reductions, not dots.

Sequence parallel (residual stream after the embedding and each sublayer laid out batch over data,
seq over model):
- forward per block: one all-gather of the normed input (seq) feeding Q, K and V (3 pairs, one
  grouped problem), a reduce-scatter of the attention output (1; its dot contracts two dimensions),
  an all-gather feeding up (1), a reduce-scatter of down (1): 6 pairs, 4 problems, 4 distinct (the
  same in every block). Unlike penzai's and keras-hub's Llamas (a gated MLP: gate and up share a
  gather, 7 pairs), GPT-2's MLP has one up projection.
- training step adds per block: the output gradients of down and of the attention output
  all-gathered (seq) into their input-gradient dots (2 pairs), the input gradients of up, Q, K and V
  reduce-scattered (seq) into the residual gradient (4 pairs), and the 6 weight gradients, whose
  gathered operand (the normed input, the MLP hidden, the attention's heads, the output gradients)
  also contracts the data-sharded batch (6 skipped pairs; their all-reduces over data used whole,
  with the LM head's).
"""

from __future__ import annotations

import pytest

pytest.importorskip("flax", reason="install requirements-models.lock (`make test` does)")
pytest.importorskip("optax", reason="install requirements-models.lock (`make test` does)")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from autotuner.hlo import extract_report  # noqa: E402

from . import flax_gpt, lm_steps, meshes  # noqa: E402
from .counts import problem_dims, sequence_collectives, summary  # noqa: E402
from .meshes import LAYERS as L  # noqa: E402

pytestmark = pytest.mark.slow

AG, RS, QKV = "all_gather:lhs:free", "reduce_scatter:free_lhs", "all_gather_group3:free"
WHOLE, DATA = "all-reduce used whole", "contracting batch sharded over data"

EXPECTED = {
    "forward": {"pairs": 0, "occurrences": 0, "distinct": 0, "patterns": {}, "skipped": {WHOLE: 2 * L}},
    "forward_sp": {"pairs": 6 * L, "occurrences": 4 * L, "distinct": 4,
                   "patterns": {QKV: L, AG: L, RS: 2 * L}, "skipped": {}},
    "train_step": {"pairs": 0, "occurrences": 0, "distinct": 0, "patterns": {},
                   "skipped": {WHOLE: 2 * L + 4 * L + 6 * L + 1}},
    # forward 4L problems; backward 2 gathers and 4 scatters per block: 10L, 8 distinct
    "train_step_sp": {"pairs": 6 * L + 6 * L + 6 * L, "occurrences": 10 * L, "distinct": 8,
                      "patterns": {QKV: L, AG: L + 2 * L, RS: 2 * L + 4 * L},
                      "skipped": {DATA: 6 * L, WHOLE: 6 * L + 1}},
}
# The blocks scanned (`nnx.scan`): one loop body holds one block's dots, so extraction finds each
# pair once, runs it L times (the loop's trip count: the same occurrences and patterns as above)
# and skips one block's weight gradients; the LM head's stays outside the loop.
EXPECTED |= {
    "forward_scan_sp": {**EXPECTED["forward_sp"], "pairs": 6},
    "train_step_scan_sp": {**EXPECTED["train_step_sp"], "pairs": 6 + 6 + 6, "skipped": {DATA: 6, WHOLE: 6 + 1}},
    # each scanned block under nnx.remat: the backward loop recomputes the block's forward up to
    # what its gradients need, i.e. all but the MLP down projection (its output is only added to
    # the residual): the Q/K/V gather (3 pairs, one problem), the attention output's reduce-scatter
    # and the up gather, 5 more pairs and 3 more problems per block, the same problems as forward's
    "train_step_scan_remat_sp": {"pairs": 6 + 5 + 12, "occurrences": (4 + 3 + 6) * L, "distinct": 8,
                                 "patterns": {QKV: 2 * L, AG: (1 + 1 + 2) * L, RS: (2 + 1 + 4) * L},
                                 "skipped": {DATA: 6, WHOLE: 6 + 1}},
}


@pytest.mark.parametrize("factory", list(EXPECTED))
def test_extraction_finds_the_hand_counted_pairs(factory: str) -> None:
    fn, args = getattr(flax_gpt, factory)()
    report = extract_report(fn, *args)
    assert report.mesh == {"data": 2, "model": 2}
    assert summary(report) == EXPECTED[factory]
    assert sequence_collectives(report) == []


def test_flax_places_the_parameters_by_their_metadata_and_the_step_learns() -> None:
    """The layout is Flax's: each kernel and bias where its `with_partitioning` metadata says; the
    forward gives finite logits and a few steps lower the loss."""
    fn, (params, tokens) = flax_gpt.forward_sp()
    attn, mlp = params["blocks"][0]["attn"], params["blocks"][0]
    assert attn["query"]["kernel"].get_value().sharding.spec == P(None, "model", None)
    assert attn["out"]["kernel"].get_value().sharding.spec == P("model", None, None)
    assert mlp["up"]["kernel"].get_value().sharding.spec == P(None, "model")
    assert mlp["up"]["bias"].get_value().sharding.spec == P("model")
    assert mlp["down"]["kernel"].get_value().sharding.spec == P("model", None)
    logits = fn(params, tokens)
    assert logits.shape == (meshes.BATCH, meshes.SEQ, meshes.VOCAB) and bool(jnp.isfinite(logits).all())
    step, (params, opt_state, tokens) = flax_gpt.train_step_sp()
    losses = []
    for _ in range(3):
        params, opt_state, loss = step(params, opt_state, tokens)
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    assert jax.tree.structure(params) == jax.tree.structure(flax_gpt.train_step_sp()[1][0])


def test_a_larger_size_keeps_the_hand_counted_pairs() -> None:
    fn, args = flax_gpt.train_step_sp(**meshes.BENCH)
    report = extract_report(fn, *args)
    assert summary(report) == EXPECTED["train_step_sp"]
    assert problem_dims(report) >= {meshes.BENCH["hidden"], meshes.BENCH["mlp"]}


def test_problems_are_named_by_the_parameters_they_multiply() -> None:
    """Flax NNX pushes no name scopes (every dot's op_name is `jit(step)/jvp()/dot_general`), so the
    name stack names nothing; the parameters' paths do (`autotuner.hlo.names.dot_label`): the
    forward dot and its transposes by the kernel they multiply."""
    fn, args = flax_gpt.train_step_sp()
    report = extract_report(fn, *args)
    assert sorted(report.names) == sorted([
        "attn/value+attn/query+attn/key", "attn/out", "blocks/up", "blocks/down", "grad/blocks/down",
        "grad/blocks/up", "grad/attn/out", "grad/attn/value+grad/attn/key+grad/attn/query"])


@pytest.mark.parametrize("factory", ["train_step_scan_sp", "train_step_scan_remat_sp"])
def test_scanned_blocks_keep_their_names_and_every_pair_decomposes(factory: str) -> None:
    """With the blocks scanned, every dot runs in a loop body (op_name `jvp()/while/body/closed_call/
    dot_general`, `nnx.scan`'s call) and multiplies one slice of a stacked parameter carried through
    the loop (under remat, through the optimization barrier around the recomputation's inputs too):
    the problems keep the unrolled step's names (the stacked argument's path, `HloModule.argument`). Every mapped pair forced to its first ring matches plain jit and none is
    left; what stays are the backward loop's weight-gradient gathers (two pairs, unmapped: they
    contract the data-sharded batch too), which the forward rings cannot serve across the loops,
    unlike the unrolled step's kept gathers; under remat the recomputed forward's rings run in the
    backward loop, beside them, and keep their gathered values for them: no gather is left. Under the default memory bound every ring stays too
    (temp +4.5%: charged before the compile, half of them were shed, to +2.3%)."""
    import re

    from autotuner import space
    from autotuner.overlap import overlap
    from autotuner.overlap.memory import DEFAULT_BOUND
    from autotuner.testing import STEP_FACTOR, TOLERANCE, relative_error

    fn, args = getattr(flax_gpt, factory)()
    report = extract_report(fn, *args)
    # under remat the backward loop's recomputed forward dots join their forward problems
    recomputed = {"attn/value+attn/query+attn/key": "attn/value+attn/query+4 more",
                  "attn/out": "attn/out+grad/attn/out", "blocks/up": "blocks/up+grad/blocks/up"}
    assert sorted(report.names) == sorted((recomputed.get(n, n) if "remat" in factory else n) for n in [
        "attn/value+attn/query+attn/key", "attn/out", "blocks/up", "blocks/down", "grad/blocks/down",
        "grad/blocks/up", "grad/attn/out", "grad/attn/value+grad/attn/key+grad/attn/query"])
    want = fn(*args)
    ov = overlap(fn, strategy=lambda p: space(p)[1], memory=None)
    plan = ov.plan(*args)
    applied = [r for r in plan if r.applied]
    assert applied == [r for r in plan if r.problem is not None and r.source != "unmapped"], "\n" + str(plan)
    counted = EXPECTED[factory]
    mapped = counted["occurrences"] + 2 * counted["patterns"][QKV]   # a grouped problem is 3 dots
    assert sum(r.count for r in applied) == mapped and {r.count for r in applied} == {L}, "\n" + str(plan)
    assert {r.name.split(" #")[0] for r in applied} >= {"attn/query", "grad/blocks/up"}, "\n" + str(plan)
    for a, b in zip(jax.tree.leaves(ov(*args)), jax.tree.leaves(want), strict=True):
        assert relative_error(a, b) <= TOLERANCE["float32"] * STEP_FACTOR
    compiled = ov._prepare(args, {}).call.as_text()   # what the calls ran
    left = re.findall(r"= f32\[[^\]]*\]\S* all-gather(?:-start)?\(", compiled)
    assert len(left) == (0 if "remat" in factory else 2), left
    if "remat" in factory:
        return
    # under the default memory bound too: rings in a loop body are not charged before the compile
    # (`overlap.memory.fit`), and the compiled step with all twelve stays inside the bound
    bounded = overlap(fn, strategy=lambda p: space(p)[1]).plan(*args)
    assert sum(r.applied for r in bounded) == len(applied), "\n" + str(bounded)
    assert bounded.memory.overlapped_bytes <= bounded.memory.plain_bytes * (1 + DEFAULT_BOUND), "\n" + str(bounded)


def test_an_nnx_jit_step_runs_as_nnx_jit_runs_it() -> None:
    """The way Flax's guide writes a training step, `@nnx.jit` updating the model and optimizer in
    place, handed to `overlap` as it would be to `nnx.jit`. Under a plain `jax.jit` those updates
    are dropped (it returns the loss and leaves the model as it was); `overlap` splits the objects
    into their state, compiles the step as a function of it and updates the objects after each call
    (`autotuner.overlap.nnx`): with every pair forced to a ring, three steps give nnx.jit's losses
    and parameters, and the plan has the backward's pairs too (the update is part of the program)."""
    import optax
    from flax import nnx

    from autotuner import space
    from autotuner.overlap import overlap
    from autotuner.testing import relative_error

    mesh = meshes.data_model_mesh()

    def build() -> tuple[flax_gpt.GPT, nnx.Optimizer]:
        def constrain(x: jax.Array) -> jax.Array:
            return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, flax_gpt.SEQUENCE))
        with jax.set_mesh(mesh):
            model = flax_gpt.GPT(meshes.TINY, constrain, nnx.Rngs(0))
            return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)

    tokens = meshes.tokens(mesh)

    @nnx.jit
    def step(model: flax_gpt.GPT, optimizer: nnx.Optimizer, tokens: jax.Array) -> jax.Array:
        loss, grads = nnx.value_and_grad(lambda model: lm_steps.next_token_loss(model(tokens), tokens))(model)
        optimizer.update(model, grads)
        return loss

    model, optimizer = build()
    first = float(jax.jit(step)(model, optimizer, tokens))
    assert float(step(model, optimizer, tokens)) == first   # plain jax.jit lost the update

    want, got = build(), build()
    ov = overlap(step, strategy=lambda p: space(p)[1], memory=None)
    plan = ov.plan(*got, tokens)
    assert sum(r.applied for r in plan) == EXPECTED["train_step_sp"]["occurrences"] + 2 * L, "\n" + str(plan)
    assert {r.name.split(" #")[0] for r in plan if r.applied} >= {"attn/query", "grad/blocks/up"}
    losses = [(float(step(*want, tokens)), float(ov(*got, tokens))) for _ in range(3)]
    assert all(abs(a - b) <= 1e-5 * abs(a) for a, b in losses) and losses[-1][0] < losses[0][0], losses
    for a, b in zip(jax.tree.leaves(nnx.state(got[0])), jax.tree.leaves(nnx.state(want[0])), strict=True):
        assert relative_error(a, b) <= 1e-3
    # one program of the objects' state, prepared once for the plan and the three calls
    assert len(ov._nnx) == 1 and len(next(iter(ov._nnx.values()))._cache) == 1

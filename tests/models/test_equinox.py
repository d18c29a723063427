"""Extraction on a GPT made of Equinox's layers (tests/models/equinox_gpt.py): the pairs counted by hand.

Counted from equinox 0.13.8's code (site-packages/equinox/nn/...), L = 2 blocks. Every projection
is an `nn.Linear`, `self.weight @ x` on one token (_linear.py:97) with the weight [out, in],
mapped over the sequence (`jax.vmap`, _attention.py:356 for query/key/value at :313-315, :352 for
the output) and over the batch by the model: so the weight is each dot's left operand and the
tokens its right one (a dot [out, in] x [batch, seq, in] -> [out, batch, seq]), the mirror of
Flax's and penzai's. Attention scores and values are einsums (_attention.py:27, :57) with the heads
local: no collective. LayerNorm has no dot; the LM head (`Linear`, replicated) is one.

The counts are Flax's GPT's (tests/models/test_flax.py), the same decoder: tensor parallel only,
2L all-reduces used whole in the forward, 2L + 4L + 6L + 1 in the step; sequence parallel, 6
pairs per block in the forward (the Q/K/V gather, one grouped problem; the attention output's
reduce-scatter; the up gather; the down reduce-scatter), 18 in the step. What differs is the side:
the forward gathers and scatters are on the dots' right operand (`all_gather:rhs:free`,
`reduce_scatter:free_rhs`, patterns no other model of the extra has), the backward input gradients
(the weight transposed on the left, times the output gradient) on their left.
"""

from __future__ import annotations

import pytest

pytest.importorskip("equinox", reason="install requirements-models.lock (`make test` does)")
pytest.importorskip("optax", reason="install requirements-models.lock (`make test` does)")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from autotuner.hlo import extract_report  # noqa: E402

from . import equinox_gpt, meshes  # noqa: E402
from .counts import sequence_collectives, summary  # noqa: E402
from .meshes import LAYERS as L  # noqa: E402

pytestmark = pytest.mark.slow

QKV = "all_gather_group3:free"
AG_L, AG_R, RS_L, RS_R = "all_gather:lhs:free", "all_gather:rhs:free", "reduce_scatter:free_lhs", "reduce_scatter:free_rhs"
WHOLE, DATA = "all-reduce used whole", "contracting batch sharded over data"

EXPECTED = {
    "forward": {"pairs": 0, "occurrences": 0, "distinct": 0, "patterns": {}, "skipped": {WHOLE: 2 * L}},
    "forward_sp": {"pairs": 6 * L, "occurrences": 4 * L, "distinct": 4,
                   "patterns": {QKV: L, AG_R: L, RS_R: 2 * L}, "skipped": {}},
    "train_step": {"pairs": 0, "occurrences": 0, "distinct": 0, "patterns": {},
                   "skipped": {WHOLE: 2 * L + 4 * L + 6 * L + 1}},
    # forward 4L problems (right side); backward 2 gathers and 4 scatters per block (left side)
    "train_step_sp": {"pairs": 18 * L, "occurrences": 10 * L, "distinct": 8,
                      "patterns": {QKV: L, AG_R: L, RS_R: 2 * L, AG_L: 2 * L, RS_L: 4 * L},
                      "skipped": {DATA: 6 * L, WHOLE: 6 * L + 1}},
}


@pytest.mark.parametrize("factory", list(EXPECTED))
def test_extraction_finds_the_hand_counted_pairs(factory: str) -> None:
    fn, args = getattr(equinox_gpt, factory)()
    report = extract_report(fn, *args)
    assert report.mesh == {"data": 2, "model": 2}
    assert summary(report) == EXPECTED[factory]
    assert sequence_collectives(report) == []


def test_the_layout_is_the_models_and_the_step_learns() -> None:
    """Each weight where the pytree of shardings put it; the forward gives finite logits, a few
    steps lower the loss; the problems are named by the weights they multiply (Equinox scopes each
    call by its class, `eqx.nn.Linear`, which names no layer)."""
    fn, (params, tokens) = equinox_gpt.forward_sp()
    block = params.blocks[0]
    assert block.attn.query_proj.weight.sharding.spec == P("model", None)
    assert block.up.bias.sharding.spec == P("model")
    assert block.attn.output_proj.weight.sharding.spec == P(None, "model")
    assert block.up.weight.sharding.spec == P("model", None)
    assert block.down.weight.sharding.spec == P(None, "model")
    logits = fn(params, tokens)
    assert logits.shape == (meshes.BATCH, meshes.SEQ, meshes.VOCAB) and bool(jnp.isfinite(logits).all())
    step, (params, opt_state, tokens) = equinox_gpt.train_step_sp()
    report = extract_report(step, params, opt_state, tokens)
    assert sorted(report.names) == sorted([
        "attn/query_proj+attn/key_proj+attn/value_proj", "attn/output_proj", "blocks/up", "blocks/down",
        "grad/blocks/down", "grad/blocks/up", "grad/attn/output_proj",
        "grad/attn/value_proj+grad/attn/key_proj+grad/attn/query_proj"])
    losses = []
    for _ in range(3):
        params, opt_state, loss = step(params, opt_state, tokens)
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    assert jax.tree.structure(params) == jax.tree.structure(equinox_gpt.train_step_sp()[1][0])

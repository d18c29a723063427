"""Extraction on keras-hub's Llama and Gemma (tests/models/keras_hub_llama.py, keras_hub_gemma.py):
the pairs counted by hand.

Counted from keras-hub 0.32.0 / Keras 3.15.1 (site-packages/...), L = 2 decoder layers
(keras_hub/src/models/llama/llama_backbone.py:155). Per layer: query/key/value/attention_output
are `EinsumDense` layers `bqm,muh->bquh`, `bkm,mvh->bkvh` (x2), `bquh,uhm->bqm`
(llama_attention.py:62-109, called at :155, :161, :200), one `ops.einsum` each
(keras/src/layers/core/einsum_dense.py:313); attention itself is `ops.dot_product_attention`
(llama_attention.py:248, taken on the JAX backend: keras_hub/src/utils/keras_utils.py:59), heads
local: no collective. The MLP is three `Dense` (llama_decoder.py:89-115, called at :167, :180,
:182), one `ops.matmul` each (keras/src/layers/core/dense.py:222); residual adds at
llama_decoder.py:163, :184. RMS norms scale elementwise (no dot). The LM head is the token
embedding's reverse `ops.matmul` (llama_causal_lm.py:49, keras/src/layers/core/reversible_embedding.py:137),
replicated.

Tensor parallel only (Megatron LayoutMap, batch over data):
- forward: attention_output and feedforward_output contract the model-sharded heads / MLP units:
  an all-reduce over model into the residual add, 2 per layer, no decomposable pair.
- training step (Keras's own train_step) adds per layer 5 all-reduces over model (input gradients of
  query/key/value/gate/intermediate) and 7 over data (weight gradients), plus the LM head's weight
  gradient: 2L + 5L + 7L + 1 all-reduces used whole, no pair.

Sequence parallel (LayoutMap entries relayout token_embedding and every transformer_layer_N output
to (data, model, None)):
- forward per layer: one all-gather (seq) feeding query, key and value (3 pairs), a reduce-scatter
  of attention_output (1), one all-gather feeding gate and intermediate (2), a reduce-scatter of
  feedforward_output (1): 7 pairs, 4 distinct problems.
- training step adds per layer 2 all-gathers of output gradients (feedforward_output and
  attention_output, into their input-gradient dots) and 5 reduce-scatters of input gradients
  (gate/intermediate, query/key/value): 7 more pairs, 4 more distinct problems; and 7 weight-gradient
  dots fed by an all-gathered operand whose batch contraction over data needs an all-reduce: pairs
  in the HLO, not Problems.

Grouped gathers (autotuner.hlo.group_pairs): the Q/K/V gather and the gate/up gather each feed several
mapped dots, so each is one grouped problem (all_gather_group3 / all_gather_group2), not 3 / 2
single ones: occurrences count the gathers the program runs, `pairs` still the HLO's dot pairs.
In the training step each gathered output gradient feeds one decomposable dot (and one skipped
weight gradient): single problems. The input-gradient dots of Q/K/V (and gate/up) are summed into
the residual gradient, but the partitioned HLO reduce-scatters each dot on its own (5 pairs per
layer, each with its own collective), so there is no grouped reduce-scatter to extract.

Gemma (keras_hub/src/models/gemma/, same versions, L = 2 `decoder_block_N`, gemma_backbone.py:156):
per layer query/key/value `EinsumDense` `btd,ndh->btnh` and `bsd,kdh->bskh` (x2) (gemma_attention.py:292,
:306, :308; kernels [heads, hidden, head_dim]), attention_output `btnh,nhd->btd` (:327), heads local
(:310); the GeGLU MLP is two `EinsumDense` `btd,df->btf`, ffw_gating and ffw_gating_2, on the same
normalized input, multiplied after a gelu, then ffw_linear (gemma_decoder_block.py:195-198);
residual adds at :192 and :203; the LM head is the tied embedding's reverse (gemma_causal_lm.py:150).
So under the same Megatron layout (kernels [heads, ...] sharded on heads, gating layers
column-parallel, ffw_linear row-parallel) and the same sequence-parallel relayout of every block's
output, every count above is Gemma's too: Q/K/V share one gather (3 pairs), ffw_gating and
ffw_gating_2 another (2), attention_output and ffw_linear each reduce-scatter (1 + 1), and the
backward mirrors Llama's.

keras-hub's own Gemma layout (`GemmaBackbone.get_layout_map`, gemma_backbone.py:213) shards every
kernel over both axes: query/key/value (model, data, None), attention_output (model, None, data),
the gating kernels (data, model), ffw_linear (model, data), the embedding (model, data); the batch
is over data and nothing is sequence parallel. Which operand GSPMD then moves depends on the sizes:
at the tiny size a layer's input (2 x 32 x 256) is smaller than its kernels, so it moves
activations, never a kernel. Per layer, in the partitioned HLO:
- forward: query, key and value each contract the hidden dimension, which is sharded over data in
  their kernels: each is reduce-scattered over data into the batch (3 problems); attention_output
  contracts heads (over model in both operands) and gathers over data: two collectives on one dot
  (a skipped pair); attention_output, ffw_gating, ffw_gating_2 and ffw_linear each all-reduce over
  model, used whole (4), and so does the LM head once: 3L problems and L skipped pairs, 4L + 1
  all-reduces used whole.
- the training step: there the LM head's forward dot is reduce-scattered over data instead, and
  the step adds one of its backward dots fed by a gather over data into its contraction (1 + 1 problems; the other gathers
  over data and contracts over model too: skipped, its all-reduce used whole); per layer,
  attention_output's two backward dots, one reduce-scattered over data and one fed by a gather over
  data into its contraction (2); of query's, key's and value's two backward dots each, one is fed by
  a gather over data into its contraction (3 problems), the other gathers over data and contracts
  over model too (3 skipped, their all-reduces used whole), and the backward dots of ffw_gating,
  ffw_gating_2 and ffw_linear all-reduce, used whole (3): 8L + 2 problems, 4L + 1 skipped pairs,
  10L + 1 all-reduces used whole.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("KERAS_BACKEND", "jax")   # before keras is first imported (its default is TensorFlow)
if os.environ["KERAS_BACKEND"] != "jax":
    pytest.skip("the keras-hub tests need KERAS_BACKEND=jax", allow_module_level=True)
pytest.importorskip("keras_hub", reason="install requirements-models.lock (`make test` does)")

from autotuner.hlo import extract_report  # noqa: E402

from . import keras_hub_gemma, keras_hub_llama, meshes  # noqa: E402
from .counts import problem_dims, sequence_collectives, summary  # noqa: E402
from .meshes import LAYERS as L  # noqa: E402

pytestmark = pytest.mark.slow

AG, RS = "all_gather:lhs:free", "reduce_scatter:free_lhs"
QKV, GATE_UP = "all_gather_group3:free", "all_gather_group2:free"   # one gather feeding 3 / 2 dots
WHOLE, DATA = "all-reduce used whole", "contracting batch sharded over data"
MODEL = "contracting dimension sharded over model"
AG_IN = {"lhs": "all_gather:lhs:contracting", "rhs": "all_gather:rhs:contracting"}   # gathered into the contraction

EXPECTED = {
    "forward": {"pairs": 0, "occurrences": 0, "distinct": 0, "patterns": {}, "skipped": {WHOLE: 2 * L}},
    # 7 pairs per layer in the HLO; the Q/K/V gather and the gate/up gather are one grouped
    # problem each (2 per layer), the two reduce-scatters single ones: 4 per layer, 4 distinct.
    "forward_sp": {"pairs": 7 * L, "occurrences": 4 * L, "distinct": 4,
                   "patterns": {QKV: L, GATE_UP: L, RS: 2 * L}, "skipped": {}},
    "train_step": {"pairs": 0, "occurrences": 0, "distinct": 0, "patterns": {},
                   "skipped": {WHOLE: 2 * L + 5 * L + 7 * L + 1}},
    # forward: 2 groups + 2 reduce-scatters per layer; backward: the 2 gathered output gradients
    # each feed one decomposable dot (their other user, the weight gradient, needs an all-reduce
    # over data: skipped), so they stay single (2 per layer); the 5 input-gradient dots each have
    # their own reduce-scatter in the HLO (5 per layer). 4L + 2L + 5L = 11L, 8 distinct.
    "train_step_sp": {"pairs": 21 * L, "occurrences": 11 * L, "distinct": 8,
                      "patterns": {QKV: L, GATE_UP: L, AG: 2 * L, RS: 2 * L + 5 * L},
                      "skipped": {DATA: 7 * L, WHOLE: 7 * L + 1}},
}

# Gemma: the Megatron layout gives Llama's counts; keras-hub's own layout (see above) moves
# activations over data only.
GEMMA = EXPECTED | {
    "forward_keras_hub": {"pairs": 4 * L, "occurrences": 3 * L, "distinct": 1, "patterns": {RS: 3 * L},
                          "skipped": {WHOLE: 4 * L + 1, MODEL: L}},
    "train_step_keras_hub": {"pairs": 12 * L + 3, "occurrences": 8 * L + 2, "distinct": 6,
                             "patterns": {AG_IN["lhs"]: 3 * L + 1, AG_IN["rhs"]: L, RS: 4 * L + 1},
                             "skipped": {WHOLE: 10 * L + 1, MODEL: 4 * L + 1}},
}
MODELS = {"keras_hub_llama": (keras_hub_llama, EXPECTED), "keras_hub_gemma": (keras_hub_gemma, GEMMA)}


@pytest.mark.parametrize(("model", "factory"), [(m, f) for m, (_, want) in MODELS.items() for f in want])
def test_extraction_finds_the_hand_counted_pairs(model: str, factory: str) -> None:
    module, expected = MODELS[model]
    fn, args = getattr(module, factory)()
    report = extract_report(fn, *args)
    assert report.mesh == {"data": 2, "model": 2}
    assert summary(report) == expected[factory]
    if factory.endswith("_keras_hub"):   # nothing sequence parallel: every problem moves over data
        assert {p.pattern.axis for p, _ in report.problems} == {"data"}
    else:
        assert sequence_collectives(report) == []


@pytest.mark.parametrize("model", list(MODELS))
def test_the_factories_run(model: str) -> None:
    """The programs extraction reads are real: finite logits, and Keras's train_step lowers the loss."""
    import jax.numpy as jnp

    module, _ = MODELS[model]
    fn, args = module.forward_sp()
    logits = fn(*args)
    assert logits.shape == (2, 32, 128) and bool(jnp.isfinite(logits).all())
    step, (state, x, y, w) = module.train_step_sp()
    losses = []
    for _ in range(3):
        logs, state = step(state, x, y, w)
        losses.append(float(logs["loss"]))
    assert losses[-1] < losses[0]


def test_a_larger_size_keeps_the_hand_counted_pairs() -> None:
    """The size the README's attribution runs at (`--kwargs` of the factory): the same pairs as
    the tiny default, on shapes of that size; a misspelt size argument is refused."""
    fn, args = keras_hub_llama.train_step_sp(**meshes.BENCH)
    report = extract_report(fn, *args)
    assert summary(report) == EXPECTED["train_step_sp"]
    assert problem_dims(report) >= {meshes.BENCH["hidden"], meshes.BENCH["mlp"]}
    with pytest.raises(ValueError, match="unknown size argument"):
        keras_hub_llama.train_step_sp(hiden=512)

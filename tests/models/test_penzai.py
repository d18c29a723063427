"""Extraction on penzai's Llama (tests/models/penzai_llama.py): the pairs counted by hand.

Counted from penzai 0.2.5's code (site-packages/penzai/...), L = 2 blocks. Every projection is a
`pz.nn.Linear`, one `jnp.einsum` (nn/linear_and_affine.py:354); per block
(models/transformer/variants/llamalike_common.py) attention query/key/value/output (:296, :317,
:331, :348), MLP gating_linear/value_linear/out_linear (:166, :176, :185), each sublayer wrapped in
`pz.nn.Residual` (nn/combinators.py:61, `delta + value`); two RMS norms whose scale is a `Linear`
with parallel axes (nn/standardization.py:187), a final norm (llamalike_common.py:499), an
unsharded lm_head (:512). Attention scores and values are `NamedEinsum`s (:272, :340) with the heads
local: no collective.

Tensor parallel only (heads/neurons over model, batch over data, residual stream replicated over model):
- forward: Q/K/V and gate/value are column-parallel (no collective); the attention output and MLP out
  contract the sharded heads/neurons, so their partial sums are all-reduced over model and the whole
  sum feeds the residual add: 2 per block, no decomposable pair.
- training step adds, per block, the input gradients of the 5 column-parallel projections (dX
  contracts the sharded heads/neurons: 5 all-reduces over model) and the 7 weight gradients (they
  contract the data-sharded batch: 7 all-reduces over data); the 3 norm-scale gradients (2 per
  block + the final norm: penzai's scale is a Linear, so its gradient is a dot) and the lm_head's
  are all-reduced over data too. No pair: 2L + 5L + 7L + (2L + 1) + 1 all-reduces used whole.

Sequence parallel (residual stream between blocks laid out batch over data, seq over model):
- forward per block: one all-gather of the normed input (seq) feeding Q, K and V (3 pairs), a
  reduce-scatter of the attention output into the residual (1), one all-gather feeding gate and
  value (2), a reduce-scatter of MLP out (1): 7 pairs, 4 distinct problems (Q/K/V alike, gate/value
  alike, the same in every block).
- training step adds per block the transposes: the output gradient of MLP out and of the attention
  output all-gathered (seq) into their input-gradient dots (2 pairs), the input gradients of
  gate/value and Q/K/V reduce-scattered (seq) into the residual gradient (5 pairs): 7 more
  decomposable pairs, 4 more distinct problems.

Grouped gathers (autotuner.hlo.group_pairs): the Q/K/V gather and the gate/up gather each feed several
mapped dots, so each is one grouped problem (all_gather_group3 / all_gather_group2), not 3 / 2
single ones: occurrences count the gathers the program runs, `pairs` still the HLO's dot pairs.
In the training step each gathered output gradient feeds one decomposable dot (and one skipped
weight gradient): single problems. The input-gradient dots of Q/K/V (and gate/up) are summed into
the residual gradient, but the partitioned HLO reduce-scatters each dot on its own (5 pairs per
layer, each with its own collective), so there is no grouped reduce-scatter to extract.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("penzai", reason="install requirements-models.lock (`make test` does)")
pytest.importorskip("optax", reason="install requirements-models.lock (`make test` does)")

from autotuner.hlo import extract_report  # noqa: E402

from . import meshes, penzai_llama  # noqa: E402
from .counts import problem_dims, sequence_collectives, summary  # noqa: E402
from .meshes import LAYERS as L  # noqa: E402

pytestmark = pytest.mark.slow

AG, RS = "all_gather:lhs:free", "reduce_scatter:free_lhs"
QKV, GATE_UP = "all_gather_group3:free", "all_gather_group2:free"   # one gather feeding 3 / 2 dots
WHOLE, DATA = "all-reduce used whole", "contracting batch sharded over data"
NORM_SCALES = 2 * L + 1   # penzai's RMS norm scales are Linear layers: their gradients are dots

EXPECTED = {
    "forward": {"pairs": 0, "occurrences": 0, "distinct": 0, "patterns": {}, "skipped": {WHOLE: 2 * L}},
    # 7 pairs per layer in the HLO; the Q/K/V gather and the gate/up gather are one grouped
    # problem each (2 per layer), the two reduce-scatters single ones: 4 per layer, 4 distinct.
    "forward_sp": {"pairs": 7 * L, "occurrences": 4 * L, "distinct": 4,
                   "patterns": {QKV: L, GATE_UP: L, RS: 2 * L}, "skipped": {}},
    "train_step": {"pairs": 0, "occurrences": 0, "distinct": 0, "patterns": {},
                   "skipped": {WHOLE: 2 * L + 5 * L + 7 * L + NORM_SCALES + 1}},
    # forward: 2 groups + 2 reduce-scatters per layer; backward: the 2 gathered output gradients
    # each feed one decomposable dot (their other user, the weight gradient, needs an all-reduce
    # over data: skipped), so they stay single (2 per layer); the 5 input-gradient dots each have
    # their own reduce-scatter in the HLO (5 per layer). 4L + 2L + 5L = 11L, 8 distinct.
    "train_step_sp": {"pairs": 21 * L, "occurrences": 11 * L, "distinct": 8,
                      "patterns": {QKV: L, GATE_UP: L, AG: 2 * L, RS: 2 * L + 5 * L},
                      "skipped": {DATA: 7 * L, WHOLE: 7 * L + NORM_SCALES + 1}},
}


@pytest.mark.parametrize("factory", list(EXPECTED))
def test_extraction_finds_the_hand_counted_pairs(factory: str) -> None:
    fn, args = getattr(penzai_llama, factory)()
    report = extract_report(fn, *args)
    assert report.mesh == {"data": 2, "model": 2}
    assert summary(report) == EXPECTED[factory]
    assert sequence_collectives(report) == []


def test_the_factories_run() -> None:
    """The programs extraction reads are real: the forward gives finite logits, a step lowers the loss."""
    import jax.numpy as jnp

    fn, args = penzai_llama.forward_sp()
    logits = fn(*args)
    assert logits.shape == (2, 32, 128) and bool(jnp.isfinite(logits).all())
    step, (params, opt_state, tokens) = penzai_llama.train_step_sp()
    losses = []
    for _ in range(3):
        params, opt_state, loss = step(params, opt_state, tokens)
        losses.append(float(loss))
    assert losses[-1] < losses[0]


def test_a_larger_size_keeps_the_hand_counted_pairs() -> None:
    """The size the README's attribution runs at (`--kwargs` of the factory): the same pairs as
    the tiny default, on shapes of that size; a bad size argument is refused."""
    fn, args = penzai_llama.train_step_sp(**meshes.BENCH)
    report = extract_report(fn, *args)
    assert summary(report) == EXPECTED["train_step_sp"]
    assert problem_dims(report) >= {meshes.BENCH["hidden"], meshes.BENCH["mlp"]}
    with pytest.raises(ValueError, match="not a multiple of heads"):
        penzai_llama.train_step_sp(hidden=500)


@pytest.mark.tpu
def test_on_xla_tpu_every_pair_maps_including_the_dots_whose_operands_it_swaps(tpu_devices, tmp_path) -> None:
    """XLA:TPU's HLO has the operands of penzai's backward dots in the other order than the traced
    equations (24 of the step's 42 pairs at this size, all left plain before); the pass decomposes
    them with their operands exchanged (tests/autotuner/overlap/test_swapped_operands.py checks
    the numerics on CPU). Every pair of the step is decomposed and the program compiles for the
    slice. XLA:TPU also keeps the shard_map bodies as called computations through its partitioner:
    the collectives of the pass's own decompositions (the baseline's gather and scatter) are not
    pairs of the next round."""
    tpu_devices("v5e:4x2")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "AUTOTUNER_DB"))}
    for strategy in ("ring-uni-c1-u1-loop-send", "baseline"):
        r = subprocess.run([sys.executable, "-m", "autotuner.cli", "plan", "tests.models.penzai_llama:train_step",
                            "--mesh", '{"data": 1, "model": 8}', "--kwargs", '{"sp": true}', "--target", "aot:tpu:v5e:4x2",
                            "--strategy", strategy, "--memory", "none"],
                           cwd=tmp_path, env={**env, "PYTHONPATH": str(Path(__file__).parents[2])},
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "42 of 42 pair(s) decomposed" in r.stdout, r.stdout[-3000:]
        assert "operand shapes differ" not in r.stdout and not re.search(r"\bunmapped\b", r.stdout)

"""Readable problem names from op_name metadata (autotuner/hlo/names.py)."""

from __future__ import annotations

import pytest

from autotuner.hlo.names import problem_names, short_name


@pytest.mark.parametrize(("op_name", "name"), [
    # keras-hub: one scope per layer, the transformation around the outermost one
    ("jit(step)/transpose(jvp(llama_backbone))/transformer_layer_0/self_attention/query/bqm,muh->bquh/dot_general",
     "grad/self_attention/query"),
    ("jit(step)/jvp(llama_backbone)/transformer_layer_1/feedforward_gate_dense/dot_general",
     "llama_backbone/feedforward_gate_dense"),
    # keras-hub Gemma: the layer that runs the dot is `ffw_gating_2`, a name of its own beside
    # `ffw_gating`, not an index; `decoder_block_1` above it is one
    ("jit(logits)/gemma_backbone/decoder_block_1/ffw_gating_2/btd,df->btf/dot_general",
     "gemma_backbone/ffw_gating_2"),
    ("jit(step)/transpose(jvp(gemma_backbone))/decoder_block_0/ffw_gating/btd,df->btf/dot_general",
     "grad/gemma_backbone/ffw_gating"),
    # Flax linen's automatic names: every scope is an index but the layer that runs the dot
    ("jit(apply)/Encoder_0/MlpBlock_3/Dense_1/dot_general", "Dense_1"),
    # jax.named_scope("attention/qkv"): one scope holding a slash, wrapped whole by jvp/transpose
    ("jit(step)/transpose(jvp(attention/qkv))/bsd,dthk->bsthk/dot_general", "grad/attention/qkv"),
    ("jit(step)/jvp(mlp/up)/dot_general", "mlp/up"),
    ("jit(fwd)/mlp/down/dot_general", "mlp/down"),
    # penzai names its sublayers by position only: the last two indices
    ("jit(step)/jvp(1)/0/1/1/0/vmap(vmap(vmap()))/dot_general", "1/0"),
    ("jit(f)/dot_general", "dot"),
    ("jit(run)/jit(forward)/bsd,df->bsf/dot_general", "bsd,df->bsf"),
    # no named scope: the einsum itself; the pass's own scope is not part of the name
    ("jit(step)/jvp(bsd,df->bsf)/dot_general", "bsd,df->bsf"),
    ("jit(step)/transpose(jvp(bsd,df->bsf))/__overlap3_1_0__/dot_general", "grad/bsd,df->bsf"),
])
def test_short_name(op_name: str, name: str) -> None:
    assert short_name(op_name) == name


def test_problem_names_join_distinct_dots_and_number_repeats() -> None:
    q = "jit(f)/attn/query/dot_general"
    k = "jit(f)/attn/key/dot_general"
    assert problem_names([[q, k, q], [q], [q]]) == ["attn/query+attn/key", "attn/query", "attn/query#2"]

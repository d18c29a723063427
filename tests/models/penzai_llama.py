"""Penzai's Llama (penzai 0.2.5, `penzai.models.transformer.variants.llamalike_common`) as factories
for `autotuner extract`:

    autotuner extract tests.models.penzai_llama:forward_sp --mesh '{"data": 2, "model": 2}' --auto -o f.json

Tensor parallelism is penzai's own name-based sharding (`penzai.toolshed.sharding_util`): each
parameter is placed by its axis names, `heads` and `neurons` over `model` (Megatron: Q/K/V and the
MLP gate/value projections column-parallel, the attention output and MLP out projections
row-parallel), the token `batch` over `data`; the embedding table and the LM head stay replicated.
Sequence parallelism (the `_sp` factories) is penzai's `ConstrainShardingByName` layer, inserted with
penzai's own model rewiring (`pz.select`) after the embedding lookup and after every transformer
block: the residual stream between blocks is laid out `batch` over data, `seq` over model.

`forward` is the LM (logits); `train_step` is `jax.value_and_grad` of the next-token cross entropy
plus an `optax.adamw` update of every parameter, the step penzai's `basic_training` runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import gpt_neox
from penzai.models.transformer.variants import llamalike_common as ll
from penzai.toolshed import sharding_util

from . import lm_steps, meshes
from .meshes import data_model_mesh

PARAM_AXES = {"heads": "model", "neurons": "model"}
ACTIVATION_AXES = {"batch": "data", "seq": "model"}


def _config(sz: meshes.Size, dtype: str = "float32") -> ll.LlamalikeTransformerConfig:
    return ll.LlamalikeTransformerConfig(
        num_kv_heads=sz.heads, query_head_multiplier=1, embedding_dim=sz.hidden,
        projection_dim=sz.head_dim, mlp_hidden_dim=sz.mlp, num_decoder_blocks=sz.layers,
        vocab_size=sz.vocab, mlp_variant="swiglu", tie_embedder_and_logits=False,
        parameter_dtype=jnp.dtype(dtype), activation_dtype=jnp.dtype(dtype))


def _neox(sz: meshes.Size, dtype: str = "float32") -> gpt_neox.GPTNeoXTransformerConfig:
    return gpt_neox.GPTNeoXTransformerConfig(
        num_attention_heads=sz.heads, embedding_dim=sz.hidden, projection_dim=sz.head_dim,
        mlp_hidden_dim=sz.mlp, num_decoder_blocks=sz.layers, vocab_size=sz.vocab,
        activation_fn="gelu_exact", rope_subset_size=sz.head_dim // 4, rope_wavelength=10_000.0,
        layernorm_epsilon=1e-5, parameter_dtype=jnp.dtype(dtype), activation_dtype=jnp.dtype(dtype))


VARIANTS = ("llama", "gpt_neox")


def build(mesh: Mesh, sp: bool, sz: meshes.Size = meshes.TINY, dtype: str = "float32",
          variant: str = "llama") -> tuple[Any, Any]:
    """(the model with its parameters unbound, the parameters placed on `mesh`); `dtype`: penzai's
    parameter and activation dtype (its config's own fields); `variant`: penzai's Llama-like
    transformer or its GPT-NeoX (parallel attention and MLP, LayerNorm, partial RoPE, GELU)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; known: {VARIANTS}")
    if variant == "gpt_neox":
        model = gpt_neox.build_gpt_neox_transformer(_neox(sz, dtype), init_base_rng=jax.random.key(0))
    else:
        model = ll.build_llamalike_transformer(_config(sz, dtype), init_base_rng=jax.random.key(0))
    if sp:
        constrain = sharding_util.ConstrainShardingByName(mesh, ACTIVATION_AXES)
        model = (pz.select(model)
                 .at_instances_of(model_parts.TransformerBlock | pz.nn.EmbeddingLookup)
                 .apply(lambda layer: pz.nn.Sequential([layer, constrain])))
    unbound, params = pz.unbind_params(model, freeze=True)
    return unbound, sharding_util.name_to_name_device_put(params, mesh, PARAM_AXES)


def _logits(unbound: Any) -> Callable[[Any, jax.Array], jax.Array]:
    def logits(params: Any, tokens: jax.Array) -> jax.Array:
        model = pz.bind_variables(unbound, params)
        out = model(pz.nx.wrap(tokens).tag("batch", "seq"))
        return out.unwrap("batch", "seq", "vocabulary")
    return logits


def forward(mesh: Mesh | None = None, sp: bool = False) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """(jitted logits(params, tokens), its arguments) on a 2x2 (data, model) mesh."""
    mesh = data_model_mesh(mesh)
    unbound, params = build(mesh, sp)
    return jax.jit(_logits(unbound)), (params, meshes.tokens(mesh))


def train_step(mesh: Mesh | None = None, sp: bool = False, dtype: str = "float32", variant: str = "llama",
               **size: int) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """(jitted step(params, opt_state, tokens) -> (params, opt_state, loss), its arguments);
    `size`: `meshes.Size`'s fields (layers, hidden, heads, mlp, vocab, batch, seq); `dtype` the
    model's parameters and activations (e.g. bfloat16, as TPU training runs); `variant` as `build`."""
    mesh = data_model_mesh(mesh)
    sz = meshes.size(**size)
    unbound, params = build(mesh, sp, sz, dtype, variant)
    return lm_steps.adamw_step(_logits(unbound), params, mesh, sz)


def forward_sp(mesh: Mesh | None = None) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """`forward` with sequence parallelism."""
    return forward(mesh, sp=True)


def train_step_sp(mesh: Mesh | None = None, variant: str = "llama",
                  **size: int) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """`train_step` with sequence parallelism (`variant`, `size` as there)."""
    return train_step(mesh, sp=True, variant=variant, **size)


def neox_train_step_sp(mesh: Mesh | None = None, **size: int) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """GPT-NeoX's `train_step_sp`, for `autotuner extract`/`tune-model`/`bench-model`."""
    return train_step_sp(mesh, variant="gpt_neox", **size)

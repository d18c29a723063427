"""keras-hub's Gemma (keras-hub 0.32.0 `GemmaCausalLM` on Keras 3.15.1, JAX backend) as factories for
`autotuner extract`, beside keras-hub's Llama (tests/models/keras_hub_llama.py), whose Keras plumbing
(tests/models/keras_steps.py) it shares:

    autotuner extract tests.models.keras_hub_gemma:train_step_sp --mesh '{"data": 2, "model": 2}' -o t.json

What differs from Llama in the model's code (keras_hub/src/models/gemma/): the query/key/value
kernels are [heads, hidden, head_dim] (`btd,ndh->btnh`, `bsd,kdh->bskh`), the MLP is GeGLU, two
`EinsumDense` layers `ffw_gating` and `ffw_gating_2` (`btd,df->btf`) multiplied after a gelu, then
`ffw_linear`; the embedding is scaled by sqrt(hidden) and tied to the LM head (the same
`ReversibleEmbedding`), and the layers are `decoder_block_N`. Multi-head attention here
(`num_key_value_heads` = heads), so the heads divide over model.

Two layouts (`layout=`):
- "megatron" (default): Llama's Megatron layout on Gemma's paths, heads and MLP units over model,
  with sequence parallelism in the `_sp` factories (token_embedding's and every decoder block's
  output laid out (data, model, None)).
- "keras_hub": keras-hub's own `GemmaBackbone.get_layout_map` (the layout its docs show, "based on
  the Gemma team training config"): every kernel sharded over both axes, heads or MLP units over
  model and the hidden dimension over data, and the embedding's vocabulary over model and hidden
  over data. Which operands GSPMD then moves depends on the sizes (tests/models/test_keras_hub_gemma.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras_hub  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from . import keras_steps, meshes  # noqa: E402


def _gemma(sz: meshes.Size) -> Any:
    """Gemma's `intermediate_dim` is both gating layers' units together (each has half), so it is
    twice `sz.mlp`: each MLP dense then has `sz.mlp` units, as Llama's."""
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=sz.vocab, num_layers=sz.layers, num_query_heads=sz.heads,
        num_key_value_heads=sz.heads, hidden_dim=sz.hidden, intermediate_dim=2 * sz.mlp,
        head_dim=sz.head_dim, dtype="float32")
    return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)


GEMMA = keras_steps.KerasLM(
    keras_hub.models.GemmaBackbone,
    {r".*attention/(query|key|value)/kernel": ("model", None, None),
     r".*attention/attention_output/kernel": ("model", None, None),
     r".*ffw_gating(_2)?/kernel": (None, "model"),
     r".*ffw_linear/kernel": ("model", None)},
    r"decoder_block_\d+", _gemma)

forward, train_step, forward_sp, train_step_sp = keras_steps.factories(GEMMA)


def forward_keras_hub(mesh: Mesh | None = None) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """`forward` with keras-hub's own layout (no sequence parallelism: that layout has none)."""
    return forward(mesh, layout="keras_hub")


def train_step_keras_hub(mesh: Mesh | None = None, layers: int = meshes.LAYERS,
                         **size: int) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """`train_step` with keras-hub's own layout."""
    return train_step(mesh, layout="keras_hub", layers=layers, **size)

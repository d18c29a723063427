"""keras-hub's Llama (keras-hub 0.32.0 `LlamaCausalLM` on Keras 3.15.1, JAX backend) as factories for
`autotuner extract`:

    autotuner extract tests.models.keras_hub_llama:train_step_sp --mesh '{"data": 2, "model": 2}' --auto -o t.json

Sharding is Keras's own distribution API: a `keras.distribution.DeviceMesh` over the mesh's devices,
a `LayoutMap` and `ModelParallel(batch_dim_name="data")`, which places every variable as the layout
map says when the model is built and shards the inputs' batch over data. The default layout is
Megatron: query/key/value kernels [hidden, heads, head_dim] and the MLP gate/intermediate kernels
column-parallel (heads / MLP units over model), attention_output and feedforward_output kernels
row-parallel; embeddings replicated. Sequence parallelism (the `_sp` factories) is the same
LayoutMap's layer-output entries (Keras relayouts a layer's output whose path matches, see
keras/src/layers/layer.py): the outputs of token_embedding and of every transformer_layer_N are laid
out (data, model, None), i.e. batch over data and sequence over model between blocks.

`layout="keras_hub"` uses keras-hub's own `LlamaBackbone.get_layout_map` instead (the layout its
docs show; it also shards the hidden dimension of every kernel, over model or data).

`forward` is the model's logits; `train_step` is Keras's own `train_step`, as `model.fit` runs it
(tests/models/keras_steps.py, which the keras-hub factories share).
"""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras_hub  # noqa: E402

from . import keras_steps, meshes  # noqa: E402


def _llama(sz: meshes.Size) -> Any:
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=sz.vocab, num_layers=sz.layers, num_query_heads=sz.heads,
        num_key_value_heads=sz.heads, hidden_dim=sz.hidden, intermediate_dim=sz.mlp, dtype="float32")
    return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)


LLAMA = keras_steps.KerasLM(
    keras_hub.models.LlamaBackbone,
    {r".*self_attention/(query|key|value)/kernel": (None, "model", None),
     r".*self_attention/attention_output/kernel": ("model", None, None),
     r".*feedforward_(gate|intermediate)_dense/kernel": (None, "model"),
     r".*feedforward_output_dense/kernel": ("model", None)},
    r"transformer_layer_\d+", _llama)

forward, train_step, forward_sp, train_step_sp = keras_steps.factories(LLAMA)

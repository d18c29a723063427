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
from collections.abc import Callable
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import keras_hub  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from . import keras_steps, meshes  # noqa: E402
from .meshes import data_model_mesh  # noqa: E402


def layout_map(device_mesh: Any, sp: bool, layout: str = "megatron") -> Any:
    if layout == "keras_hub":
        lm = keras_hub.models.LlamaBackbone.get_layout_map(
            device_mesh, model_parallel_dim_name="model", data_parallel_dim_name="data")
    elif layout == "megatron":
        lm = keras.distribution.LayoutMap(device_mesh)
        lm[r".*self_attention/(query|key|value)/kernel"] = (None, "model", None)
        lm[r".*self_attention/attention_output/kernel"] = ("model", None, None)
        lm[r".*feedforward_(gate|intermediate)_dense/kernel"] = (None, "model")
        lm[r".*feedforward_output_dense/kernel"] = ("model", None)
    else:
        raise ValueError(f"layout must be 'megatron' or 'keras_hub', got {layout!r}")
    if sp:
        lm[r".*(token_embedding|transformer_layer_\d+)/output"] = ("data", "model", None)
    return lm


def build(mesh: Mesh, sp: bool, layout: str = "megatron", sz: meshes.Size = meshes.TINY) -> tuple[Any, Any]:
    """(the compiled LlamaCausalLM, its ModelParallel distribution), variables placed on `mesh`."""
    dist = keras.distribution.ModelParallel(layout_map=layout_map(keras_steps.device_mesh(mesh), sp, layout),
                                            batch_dim_name="data")

    def llama() -> Any:
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=sz.vocab, num_layers=sz.layers, num_query_heads=sz.heads,
            num_key_value_heads=sz.heads, hidden_dim=sz.hidden, intermediate_dim=sz.mlp,
            dtype="float32")
        return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)

    return keras_steps.compiled(llama, dist), dist


def forward(mesh: Mesh | None = None, sp: bool = False, layout: str = "megatron"
            ) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """(jitted logits(trainable, non_trainable, x), its arguments) on a 2x2 (data, model) mesh."""
    mesh = data_model_mesh(mesh)
    return keras_steps.forward(*build(mesh, sp, layout), mesh)


def train_step(mesh: Mesh | None = None, sp: bool = False, layout: str = "megatron",
               layers: int = meshes.LAYERS, **size: int) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """(jitted Keras train_step(state, x, y, sample_weight) -> (logs, state), its arguments);
    `size`: `meshes.Size`'s fields other than layers (hidden, heads, mlp, vocab, batch, seq)."""
    mesh = data_model_mesh(mesh)
    sz = meshes.size(layers=layers, **size)
    return keras_steps.train_step(*build(mesh, sp, layout, sz), mesh, sz)


def forward_sp(mesh: Mesh | None = None, layout: str = "megatron") -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """`forward` with sequence parallelism."""
    return forward(mesh, sp=True, layout=layout)


def train_step_sp(mesh: Mesh | None = None, layout: str = "megatron", layers: int = meshes.LAYERS,
                  **size: int) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """`train_step` with sequence parallelism (`layers` transformer blocks, `size` as there)."""
    return train_step(mesh, sp=True, layout=layout, layers=layers, **size)

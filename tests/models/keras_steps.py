"""What the keras-hub factories share (tests/models/keras_hub_llama.py, keras_hub_gemma.py): a model
described once (`KerasLM`: its backbone, its Megatron layout, its blocks), its two layouts as a Keras
`LayoutMap`, Keras's distribution API over a JAX mesh, the inputs, and the factories of its two
programs (`factories`): a causal LM's logits and Keras's own `train_step` (value_and_grad of the
compiled loss, sparse categorical cross entropy, and an AdamW `stateless_apply`), as `model.fit`
runs it, each jitted with its arguments, with and without sequence parallelism."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from . import meshes  # noqa: E402
from .meshes import data_model_mesh  # noqa: E402

if keras.config.backend() != "jax":
    raise ImportError(f"the keras-hub factories need the Keras JAX backend, Keras runs {keras.config.backend()!r} "
                      "(set KERAS_BACKEND=jax before importing keras)")


LAYOUTS = ("megatron", "keras_hub")
Factory = Callable[..., tuple[Callable[..., Any], tuple[Any, ...]]]


@dataclass(frozen=True)
class KerasLM:
    """A keras-hub causal LM as the factories build it."""

    backbone: Any                          # its keras-hub backbone class: `get_layout_map` is the keras_hub layout
    megatron: dict[str, tuple[Any, ...]]   # kernel path regex -> its Megatron layout
    blocks: str                            # the regex of its blocks' names (their outputs relaid for sp)
    causal_lm: Callable[[meshes.Size], Any]   # the model of a size, unbuilt


def layout_map(lm: KerasLM, device_mesh: Any, sp: bool, layout: str = "megatron") -> Any:
    """`layout` ("megatron", or "keras_hub": the backbone's own `get_layout_map`) as a Keras
    LayoutMap; `sp`: token_embedding's and every block's output laid out (data, model, None)."""
    if layout == "keras_hub":
        out = lm.backbone.get_layout_map(device_mesh, model_parallel_dim_name="model", data_parallel_dim_name="data")
    elif layout == "megatron":
        out = keras.distribution.LayoutMap(device_mesh)
        for path, spec in lm.megatron.items():
            out[path] = spec
    else:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if sp:
        out[rf".*(token_embedding|{lm.blocks})/output"] = ("data", "model", None)
    return out


def build(lm: KerasLM, mesh: Mesh, sp: bool, layout: str = "megatron", sz: meshes.Size = meshes.TINY
          ) -> tuple[Any, Any]:
    """(the compiled causal LM, its ModelParallel distribution), variables placed on `mesh`."""
    dist = keras.distribution.ModelParallel(layout_map=layout_map(lm, device_mesh(mesh), sp, layout),
                                            batch_dim_name="data")
    return compiled(lambda: lm.causal_lm(sz), dist), dist


def factories(lm: KerasLM) -> tuple[Factory, Factory, Factory, Factory]:
    """The model's factories for `autotuner extract` and the tests: forward, train_step,
    forward_sp, train_step_sp, on a 2x2 (data, model) mesh unless given one."""

    def forward_(mesh: Mesh | None = None, sp: bool = False, layout: str = "megatron"
                 ) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """(jitted logits(trainable, non_trainable, x), its arguments)."""
        mesh = data_model_mesh(mesh)
        return forward(*build(lm, mesh, sp, layout), mesh)

    def train_step_(mesh: Mesh | None = None, sp: bool = False, layout: str = "megatron",
                    layers: int = meshes.LAYERS, **size: int) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """(jitted Keras train_step(state, x, y, sample_weight) -> (logs, state), its arguments);
        `size`: `meshes.Size`'s fields other than layers (hidden, heads, mlp, vocab, batch, seq)."""
        mesh = data_model_mesh(mesh)
        sz = meshes.size(layers=layers, **size)
        return train_step(*build(lm, mesh, sp, layout, sz), mesh, sz)

    def forward_sp(mesh: Mesh | None = None, layout: str = "megatron") -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """`forward` with sequence parallelism."""
        return forward_(mesh, sp=True, layout=layout)

    def train_step_sp(mesh: Mesh | None = None, layout: str = "megatron", layers: int = meshes.LAYERS,
                      **size: int) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """`train_step` with sequence parallelism (`layers` blocks, `size` as there)."""
        return train_step_(mesh, sp=True, layout=layout, layers=layers, **size)

    return forward_, train_step_, forward_sp, train_step_sp


def device_mesh(mesh: Mesh) -> Any:
    """`mesh` as a `keras.distribution.DeviceMesh` (same shape, axis names and devices)."""
    return keras.distribution.DeviceMesh(tuple(mesh.devices.shape), tuple(mesh.axis_names), list(mesh.devices.flat))


def compiled(build: Callable[[], Any], dist: Any) -> Any:
    """The causal LM `build()` returns, built in `dist`'s scope (its variables placed as the
    layout map says), compiled with AdamW and its optimizer variables built. Seeded, so every
    process of a multi-process run builds the same model."""
    keras.utils.set_random_seed(0)
    with dist.scope():
        model = build()
        model.compile(optimizer=keras.optimizers.AdamW(1e-3), sampler="greedy")
        model.optimizer.build(model.trainable_variables)
    return model


def inputs(mesh: Mesh, sz: meshes.Size = meshes.TINY) -> tuple[dict[str, jax.Array], jax.Array, jax.Array]:
    """(x, y, sample_weight): token ids and padding mask, next-token targets and their weights."""
    ids = meshes.tokens(mesh, sz=sz)
    data = NamedSharding(mesh, P("data", None))
    y = jax.device_put(jnp.roll(ids, -1, axis=1), data)
    w = jax.device_put(jnp.ones(ids.shape, jnp.int32).at[:, -1].set(0), data)
    return {"token_ids": ids, "padding_mask": jax.device_put(jnp.ones(ids.shape, jnp.int32), data)}, y, w


def forward(model: Any, dist: Any, mesh: Mesh, sz: meshes.Size = meshes.TINY
            ) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """(jitted logits(trainable, non_trainable, x), its arguments)."""
    def logits(trainable: list[jax.Array], non_trainable: list[jax.Array], x: dict[str, jax.Array]) -> jax.Array:
        with dist.scope():   # the layer-output relayouts apply while tracing
            out, _ = model.stateless_call(trainable, non_trainable, x)
        return out

    x, _, _ = inputs(mesh, sz)
    return jax.jit(logits), ([v.value for v in model.trainable_variables],
                             [v.value for v in model.non_trainable_variables], x)


def train_step(model: Any, dist: Any, mesh: Mesh, sz: meshes.Size = meshes.TINY
               ) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """(jitted Keras train_step(state, x, y, sample_weight) -> (logs, state), its arguments)."""
    def step(state: Any, x: dict[str, jax.Array], y: jax.Array, w: jax.Array) -> Any:
        with dist.scope():
            return model.train_step(state, (x, y, w))

    state = tuple([v.value for v in vs] for vs in (
        model.trainable_variables, model.non_trainable_variables, model.optimizer.variables,
        model.metrics_variables))
    return jax.jit(step), (state, *inputs(mesh, sz))

"""What the keras-hub factories share (tests/models/keras_hub_llama.py, keras_hub_gemma.py): Keras's
distribution API over a JAX mesh, the inputs, and the two programs, a causal LM's logits and Keras's
own `train_step` (value_and_grad of the compiled loss, sparse categorical cross entropy, and an
AdamW `stateless_apply`), as `model.fit` runs it, each jitted with its arguments."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from . import meshes  # noqa: E402

if keras.config.backend() != "jax":
    raise ImportError(f"the keras-hub factories need the Keras JAX backend, Keras runs {keras.config.backend()!r} "
                      "(set KERAS_BACKEND=jax before importing keras)")


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

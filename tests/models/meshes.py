"""The mesh the real-model factories run on: 2x2, axes (data, model), GSPMD (Auto) axis types."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import AxisType, Mesh

AXES = ("data", "model")

# One tiny Llama-style shape for every library: 2 layers, hidden 256, 8 heads of 32, MLP 512.
# Batch 2 x seq 32 means 32 tokens per device on the 2x2 mesh, fewer than the hidden size: then
# GSPMD all-gathers the (smaller) activations, as Megatron sequence parallelism does. With as many
# tokens per device as hidden units (e.g. hidden 64, batch 4) it gathers the weights instead, a
# different program with different pairs.
LAYERS, HIDDEN, HEADS, HEAD_DIM, MLP, VOCAB = 2, 256, 8, 32, 512, 128
BATCH, SEQ = 2, 32


def data_model_mesh(mesh: Mesh | None = None) -> Mesh:
    """`mesh` if it has the axes data and model, else a new 2x2 one over the first 4 devices."""
    if mesh is None:
        if jax.device_count() < 4:
            raise ValueError(f"needs 4 devices, JAX has {jax.device_count()}")
        return jax.make_mesh((2, 2), AXES, axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:4])
    if set(AXES) - set(mesh.axis_names):
        raise ValueError(f"needs a mesh with axes {AXES}, got {tuple(mesh.axis_names)}")
    return mesh


def tokens(mesh: Mesh, seed: int = 0) -> Any:
    """[BATCH, SEQ] int32 token ids, the batch sharded over data."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    ids = jax.random.randint(jax.random.key(seed), (BATCH, SEQ), 0, VOCAB, dtype="int32")
    return jax.device_put(ids, NamedSharding(mesh, P("data", None)))

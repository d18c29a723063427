"""The mesh the real-model factories run on: 2x2, axes (data, model), GSPMD (Auto) axis types."""

from __future__ import annotations

from dataclasses import dataclass, fields
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


@dataclass(frozen=True)
class Size:
    """A model's size: the tiny default above, or what a factory's keyword arguments set (e.g.
    `--kwargs '{"hidden": 512, "mlp": 1024, "seq": 128}'` for a step whose collectives move
    enough to time). Keep batch x seq / model below hidden for sequence parallelism (see above)."""

    layers: int = LAYERS
    hidden: int = HIDDEN
    heads: int = HEADS
    mlp: int = MLP
    vocab: int = VOCAB
    batch: int = BATCH
    seq: int = SEQ

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


TINY = Size()
# The size the README's attribution and tune-model runs use (`bench/tune_model.sh`'s KW).
BENCH = {"hidden": 512, "heads": 8, "mlp": 1024, "batch": 2, "seq": 192}


def size(**kw: int) -> Size:
    """A Size from keyword arguments (unknown names, non-integers or a hidden size the heads do not
    divide raise ValueError)."""
    names = {f.name for f in fields(Size)}
    bad = sorted(set(kw) - names)
    if bad:
        raise ValueError(f"unknown size argument(s) {bad}; known: {sorted(names)}")
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in kw.values()):
        raise ValueError(f"size arguments must be positive integers, got {kw}")
    got = Size(**kw)
    if got.hidden % got.heads:
        raise ValueError(f"hidden {got.hidden} is not a multiple of heads {got.heads}")
    return got


def data_model_mesh(mesh: Mesh | None = None) -> Mesh:
    """`mesh` if it has the axes data and model, else a new 2x2 one over the first 4 devices."""
    if mesh is None:
        if jax.device_count() < 4:
            raise ValueError(f"needs 4 devices, JAX has {jax.device_count()}")
        return jax.make_mesh((2, 2), AXES, axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:4])
    if set(AXES) - set(mesh.axis_names):
        raise ValueError(f"needs a mesh with axes {AXES}, got {tuple(mesh.axis_names)}")
    return mesh


def tokens(mesh: Mesh, seed: int = 0, sz: Size = TINY) -> Any:
    """[batch, seq] int32 token ids, the batch sharded over data."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    ids = jax.random.randint(jax.random.key(seed), (sz.batch, sz.seq), 0, sz.vocab, dtype="int32")
    return jax.device_put(ids, NamedSharding(mesh, P("data", None)))

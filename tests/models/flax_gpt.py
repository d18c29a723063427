"""A GPT-2-style decoder made of Flax NNX's own layers (flax 0.12.8, `flax.nnx`) as factories for
`autotuner extract`:

    autotuner extract tests.models.flax_gpt:train_step_sp --mesh '{"data": 2, "model": 2}' --auto -o f.json

What runs is Flax's code: `nnx.Embed`, `nnx.LayerNorm`, `nnx.MultiHeadAttention` (its Q/K/V and
output projections are `nnx.LinearGeneral`s, a `lax.dot_general` each; the output one contracts
heads and head_dim together) with `nnx.dot_product_attention` under `nnx.make_causal_mask`, and
`nnx.Linear` for the MLP and the LM head. This module only stacks them (pre-norm blocks,
`x + attn(ln(x))`, `x + down(gelu(up(ln(x))))`) and writes the layout the way Flax's "Scale up
on multiple devices" guide does: every kernel's and bias's partitioning as Flax metadata
(`nnx.with_partitioning`), the model created under the mesh (`jax.set_mesh`), so that Flax places
each parameter by it (its eager sharding). Megatron
tensor parallelism: Q/K/V kernels [hidden, heads, head_dim] and the MLP up kernel column-parallel
(heads / mlp over model), the attention output kernel [heads, head_dim, hidden] and the MLP down
kernel row-parallel; embedding, norms and LM head replicated. The attention has no biases (a key
bias's gradient is zero, softmax being shift-invariant, so the optimizer's moments of it are rounding
noise that no comparison with plain jit can check). Sequence parallelism (the `_sp`
factories): the residual stream after the embedding and after each sublayer is constrained to
(batch over data, seq over model).

The `_scan_sp` factories build the same model with its blocks scanned the way Flax's `nnx.scan`
docs do it (parameters stacked on a leading unsharded axis by `nnx.vmap` under `nnx.split_rngs`,
the blocks run by `nnx.scan`), sequence parallel; `train_step_scan_remat_sp` with each block under
`nnx.remat` too.

The programs are pure functions of the model's `nnx.Param` state (`nnx.split` / `nnx.merge`, Flax's
functional API): `forward` the logits, `train_step` `jax.value_and_grad` of the next-token cross
entropy plus an `optax.adamw` update of every parameter.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from . import lm_steps, meshes

SEQUENCE = P("data", "model", None)   # the residual stream's layout under sequence parallelism


def _kernel(*spec: str | None) -> Any:
    return nnx.with_partitioning(nnx.initializers.lecun_normal(), spec)


def _bias(*spec: str | None) -> Any:
    return nnx.with_partitioning(nnx.initializers.zeros_init(), spec)


class Block(nnx.Module):
    def __init__(self, sz: meshes.Size, constrain: Callable[[jax.Array], jax.Array], rngs: nnx.Rngs):
        self.constrain = constrain
        self.ln1 = nnx.LayerNorm(sz.hidden, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(sz.heads, sz.hidden, decode=False, use_bias=False,
                                           kernel_init=_kernel(None, "model", None),
                                           out_kernel_init=_kernel("model", None, None), rngs=rngs)
        self.ln2 = nnx.LayerNorm(sz.hidden, rngs=rngs)
        self.up = nnx.Linear(sz.hidden, sz.mlp, kernel_init=_kernel(None, "model"), bias_init=_bias("model"), rngs=rngs)
        self.down = nnx.Linear(sz.mlp, sz.hidden, kernel_init=_kernel("model", None), bias_init=_bias(None), rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = self.constrain(x + self.attn(self.ln1(x), mask=mask))
        return self.constrain(x + self.down(nnx.gelu(self.up(self.ln2(x)))))


class GPT(nnx.Module):
    def __init__(self, sz: meshes.Size, constrain: Callable[[jax.Array], jax.Array], rngs: nnx.Rngs,
                 scan: bool = False, remat: bool = False):
        self.constrain, self.scan, self.remat = constrain, scan, remat
        self.embed = nnx.Embed(sz.vocab, sz.hidden, rngs=rngs)
        if scan:   # the blocks' parameters stacked on a leading, unsharded layer axis
            @nnx.split_rngs(splits=sz.layers)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
            def create(rngs: nnx.Rngs) -> Block:
                return Block(sz, constrain, rngs)
            self.blocks = create(rngs)
        else:
            self.blocks = nnx.List([Block(sz, constrain, rngs) for _ in range(sz.layers)])
        self.ln = nnx.LayerNorm(sz.hidden, rngs=rngs)
        self.head = nnx.Linear(sz.hidden, sz.vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.constrain(self.embed(tokens))
        mask = nnx.make_causal_mask(tokens)
        if self.scan:
            def run(x: jax.Array, block: Block) -> jax.Array:
                return block(x, mask)
            x = nnx.scan(nnx.remat(run) if self.remat else run, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(x, self.blocks)
        else:
            for block in self.blocks:
                x = block(x, mask)
        return self.head(self.ln(x))


def build(mesh: Mesh, sp: bool, sz: meshes.Size = meshes.TINY, scan: bool = False,
          remat: bool = False) -> tuple[lm_steps.Logits, Any]:
    """(logits(params, tokens), the nnx.Param state, placed on `mesh` by its partitioning metadata);
    the rest of the state (the attention's dropout RNG streams) is merged in as a constant.
    `scan`: the blocks run as Flax's `nnx.scan` over their stacked parameters; `remat`: each
    scanned block under `nnx.remat` (its forward recomputed in the backward loop)."""
    def constrain(x: jax.Array) -> jax.Array:
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, SEQUENCE)) if sp else x

    with jax.set_mesh(mesh):   # Flax creates each annotated variable sharded (its eager sharding)
        model = GPT(sz, constrain, nnx.Rngs(0), scan, remat)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def logits(params: Any, tokens: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, params, rest)(tokens)
    return logits, params


forward, train_step, forward_sp, train_step_sp = lm_steps.factories(build)
# the same model with its blocks scanned (`nnx.scan`), sequence parallel: what a deep model does to
# compile one block instead of L
_, _, forward_scan_sp, train_step_scan_sp = lm_steps.factories(functools.partial(build, scan=True))
# and each scanned block rematerialized (`nnx.remat`), as deep models trade compute for memory
train_step_scan_remat_sp = lm_steps.factories(functools.partial(build, scan=True, remat=True))[3]

"""A GPT-2-style decoder made of Equinox's own layers (equinox 0.13.8, `equinox.nn`) as factories
for `autotuner extract`:

    autotuner extract tests.models.equinox_gpt:train_step_sp --mesh '{"data": 2, "model": 2}' -o f.json

What runs is Equinox's code: `eqx.nn.Embedding`, `eqx.nn.LayerNorm`, `eqx.nn.MultiheadAttention`
(its query/key/value/output projections are `eqx.nn.Linear`s, each `weight @ x` on one token,
mapped over the sequence with `jax.vmap`) and `eqx.nn.Linear` for the MLP and the LM head. Equinox
layers see one example: a block maps one sequence, and the model maps it over the batch with
`jax.vmap`, as Equinox's examples do; the weight is then the left operand of every projection's
dot (a weight [out, in] times the tokens), where Flax and penzai put it on the right. This module
only stacks the layers (pre-norm blocks, `x + attn(ln(x))`, `x + down(gelu(up(ln(x))))`) and lays the
model out the way Equinox's sharding example does: a pytree of shardings of the model's shape
(`jax.device_put(model, shardings)`, built with `eqx.tree_at`). Megatron tensor parallelism: the
query/key/value and MLP up weights [out, in] split over model on their output rows (column
parallel), the attention output and MLP down weights on their input columns (row parallel);
embedding, norms and LM head replicated. The attention keeps Equinox's default of no projection
biases (a key bias has a zero gradient, softmax being shift-invariant, so the optimizer's moments of
it are rounding noise that no comparison with plain jit can check). Sequence parallelism (the `_sp` factories): the residual
stream after the embedding and after each block, [batch, seq, hidden], constrained to (batch over
data, seq over model) between the mapped blocks.

The programs are pure functions of the model's arrays (`eqx.partition` / `eqx.combine`, Equinox's
filtered API): `forward` the logits, `train_step` `jax.value_and_grad` of the next-token cross
entropy plus an `optax.adamw` update of every parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from . import lm_steps, meshes

SEQUENCE = P("data", "model", None)   # the residual stream's layout under sequence parallelism


class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, sz: meshes.Size, key: jax.Array):
        ka, ku, kd = jax.random.split(key, 3)
        self.ln1 = eqx.nn.LayerNorm(sz.hidden)
        self.attn = eqx.nn.MultiheadAttention(sz.heads, sz.hidden, key=ka)   # Equinox's default: no biases
        self.ln2 = eqx.nn.LayerNorm(sz.hidden)
        self.up = eqx.nn.Linear(sz.hidden, sz.mlp, key=ku)
        self.down = eqx.nn.Linear(sz.mlp, sz.hidden, key=kd)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        """One sequence [seq, hidden]."""
        h = jax.vmap(self.ln1)(x)
        x = x + self.attn(h, h, h, mask=mask)
        h = jax.vmap(self.ln2)(x)
        return x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(h)))


class GPT(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: list[Block]
    ln: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, sz: meshes.Size, key: jax.Array):
        ke, kh, *kb = jax.random.split(key, 2 + sz.layers)
        self.embed = eqx.nn.Embedding(sz.vocab, sz.hidden, key=ke)
        self.blocks = [Block(sz, k) for k in kb]
        self.ln = eqx.nn.LayerNorm(sz.hidden)
        self.head = eqx.nn.Linear(sz.hidden, sz.vocab, use_bias=False, key=kh)

    def __call__(self, tokens: jax.Array, constrain: Callable[[jax.Array], jax.Array]) -> jax.Array:
        """A batch of token ids [batch, seq] -> logits [batch, seq, vocab]."""
        x = constrain(jax.vmap(jax.vmap(self.embed))(tokens))
        mask = jnp.tril(jnp.ones((tokens.shape[1], tokens.shape[1]), bool))
        for block in self.blocks:
            x = constrain(jax.vmap(block, in_axes=(0, None))(x, mask))
        return jax.vmap(jax.vmap(lambda t: self.head(self.ln(t))))(x)


def _layout(params: GPT, mesh: Mesh) -> Any:
    """The shardings of the model's arrays, a pytree of its shape: Megatron on the blocks, the
    rest replicated."""
    def spec(*s: str | None) -> NamedSharding:
        return NamedSharding(mesh, P(*s))

    out = jax.tree.map(lambda _: spec(), params)
    column, row = spec("model", None), spec(None, "model")   # a weight is [out, in]
    for i in range(len(params.blocks)):
        def megatron(t: GPT, i: int = i) -> tuple[Any, ...]:
            b = t.blocks[i]
            a = b.attn
            return (a.query_proj.weight, a.key_proj.weight, a.value_proj.weight, b.up.weight, b.up.bias,
                    a.output_proj.weight, b.down.weight)
        out = eqx.tree_at(megatron, out, (column, column, column, column, spec("model"), row, row))
    return out


def build(mesh: Mesh, sp: bool, sz: meshes.Size = meshes.TINY) -> tuple[lm_steps.Logits, Any]:
    """(logits(params, tokens), the model's arrays placed on `mesh`); the rest of the model (static)
    is combined in as a constant."""
    params, static = eqx.partition(GPT(sz, jax.random.key(0)), eqx.is_array)

    def constrain(x: jax.Array) -> jax.Array:
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, SEQUENCE)) if sp else x

    def logits(params: Any, tokens: jax.Array) -> jax.Array:
        return eqx.combine(params, static)(tokens, constrain)
    return logits, jax.device_put(params, _layout(params, mesh))


forward, train_step, forward_sp, train_step_sp = lm_steps.factories(build)

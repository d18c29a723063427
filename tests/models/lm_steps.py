"""The programs the functional models' factories share (penzai's Llama, the Flax NNX and Equinox
GPTs): the next-token cross entropy, an `optax.adamw` training step of a logits function, and the
four factories of a model described by its `build`. Keras's models run Keras's own step instead
(tests/models/keras_steps.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from . import meshes
from .meshes import data_model_mesh

Logits = Callable[[Any, jax.Array], jax.Array]   # logits(params, tokens) -> [batch, seq, vocab]
Factory = Callable[..., tuple[Callable[..., Any], tuple[Any, ...]]]


def next_token_loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """The mean cross entropy of each position's logits against the next token."""
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def adamw_step(logits: Logits, params: Any, mesh: Mesh, sz: meshes.Size) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """(jitted step(params, opt_state, tokens) -> (params, opt_state, loss), its arguments):
    `jax.value_and_grad` of `next_token_loss` and an `optax.adamw` update of every parameter."""
    opt = optax.adamw(1e-3)

    def loss_fn(params: Any, tokens: jax.Array) -> jax.Array:
        return next_token_loss(logits(params, tokens), tokens)

    def step(params: Any, opt_state: Any, tokens: jax.Array) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step), (params, jax.jit(opt.init)(params), meshes.tokens(mesh, sz=sz))


def factories(build: Callable[[Mesh, bool, meshes.Size], tuple[Logits, Any]]) -> tuple[Factory, ...]:
    """(forward, train_step, forward_sp, train_step_sp) of a model whose `build(mesh, sp, size)`
    gives (its logits function, its parameters placed on `mesh`), each taking `mesh` (default a
    2x2 (data, model) one) and `meshes.Size`'s fields as keywords."""
    def forward(mesh: Mesh | None = None, sp: bool = False, **size: int) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """(jitted logits(params, tokens), its arguments)."""
        mesh, sz = data_model_mesh(mesh), meshes.size(**size)
        logits, params = build(mesh, sp, sz)
        return jax.jit(logits), (params, meshes.tokens(mesh, sz=sz))

    def train_step(mesh: Mesh | None = None, sp: bool = False,
                   **size: int) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """(jitted step(params, opt_state, tokens) -> (params, opt_state, loss), its arguments)."""
        mesh, sz = data_model_mesh(mesh), meshes.size(**size)
        return adamw_step(*build(mesh, sp, sz), mesh, sz)

    def forward_sp(mesh: Mesh | None = None, **size: int) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """`forward` with sequence parallelism."""
        return forward(mesh, sp=True, **size)

    def train_step_sp(mesh: Mesh | None = None, **size: int) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """`train_step` with sequence parallelism."""
        return train_step(mesh, sp=True, **size)

    return forward, train_step, forward_sp, train_step_sp

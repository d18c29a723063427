"""A small transformer in plain JAX: Megatron tensor parallelism + sequence parallelism.

On a mesh axis `model` (4 devices in the examples) the activations between blocks are
[batch, seq, d_model] sharded on seq. Per block:

- LayerNorm, local on the sequence shard;
- QKV projection, column-parallel (heads sharded): all-gather of the sequence before it;
- attention, local per head;
- attention output projection, row-parallel (heads contracted): reduce-scatter over the sequence;
- LayerNorm, MLP up (column-parallel, all-gather before), GELU, MLP down (row-parallel,
  reduce-scatter after).

Every projection goes through one indirection, `proj(equation, x, w, out_spec)`, which computes
the einsum with `x` and `w` laid out as they come and the result laid out as `out_spec`, adding the
one collective the layout needs (an all-gather of an operand first, or a reduce-scatter of the
result). The default, `plain_proj`, is `jax.reshard` + `jnp.einsum(..., out_sharding=...)`, from
which GSPMD emits exactly those collectives; pass another `proj` (e.g. one that routes through
`autotuner.collective_einsum`) to `block`/`forward`.

The mesh uses explicit sharding (`AxisType.Explicit`), so every array's layout is part of its type;
on a mesh whose axes are Auto (`--mesh` without `--explicit`) `plain_proj` constrains each result
to its layout and GSPMD places the collectives.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from autotuner.problem import Problem

AXIS = "model"
Proj = Callable[[str, jax.Array, jax.Array, P], jax.Array]


@dataclass(frozen=True)
class Config:
    batch: int = 2
    seq: int = 64
    d_model: int = 64
    heads: int = 8
    d_head: int = 8
    d_ff: int = 256
    layers: int = 2
    dtype: str = "float32"
    axis: str = AXIS
    batch_axis: str | None = None   # a data-parallel mesh axis sharding the batch, if any


def make_mesh(n: int = 4, axis: str = AXIS) -> Mesh:
    """A 1-D explicit-sharding mesh over the first n devices."""
    return jax.make_mesh((n,), (axis,), axis_types=(AxisType.Explicit,), devices=jax.devices()[:n])


def _spec_of(x: jax.Array) -> tuple[Any, ...]:
    spec = tuple(jax.typeof(x).sharding.spec)
    return spec + (None,) * (x.ndim - len(spec))


def _entry(e: Any) -> Any:
    return list(e) if isinstance(e, tuple) else e


def layout_problem(equation: str, x: jax.Array, w: jax.Array, out_spec: P, mesh: Mesh) -> Problem:
    """The Problem a projection is: shapes, the operands' current layouts, the result layout."""
    out = tuple(out_spec) + (None,) * (len(equation.split("->")[1]) - len(tuple(out_spec)))
    return Problem.from_dict({
        "equation": equation,
        "lhs": {"shape": list(x.shape), "spec": [_entry(e) for e in _spec_of(x)]},
        "rhs": {"shape": list(w.shape), "spec": [_entry(e) for e in _spec_of(w)]},
        "out_spec": [_entry(e) for e in out],
        "dtype": jnp.dtype(x.dtype).name,
        "mesh": dict(zip(mesh.axis_names, (int(s) for s in mesh.axis_sizes), strict=True)),
    })


def _pentry(e: tuple[str, ...]) -> Any:
    return None if not e else e[0] if len(e) == 1 else tuple(e)


def plain_proj(equation: str, x: jax.Array, w: jax.Array, out_spec: P, mesh: Mesh | None = None) -> jax.Array:
    """The einsum with the collective its layout needs, as GSPMD emits it (no overlap). On a mesh
    whose axes are Auto (`mesh`: the concrete mesh), the result is constrained to `out_spec` and
    GSPMD places the collective; on an Explicit one it is written out."""
    if mesh is not None and AxisType.Explicit not in set(mesh.axis_types):
        return jax.lax.with_sharding_constraint(jnp.einsum(equation, x, w), NamedSharding(mesh, out_spec))
    mesh = jax.typeof(x).sharding.mesh
    p = layout_problem(equation, x, w, out_spec, mesh)
    pat = p.pattern
    if pat.kind == "all_gather":
        op = p.lhs if pat.operand == "lhs" else p.rhs
        letters = p.eq.lhs if pat.operand == "lhs" else p.eq.rhs
        i = letters.index(pat.letter)
        spec = [_pentry(e) for e in op.spec]
        spec[i] = _pentry(op.spec[i][:-1])   # the gathered letter loses the collective's axis
        gathered = jax.reshard(x if pat.operand == "lhs" else w, NamedSharding(mesh, P(*spec)))
        x, w = (gathered, w) if pat.operand == "lhs" else (x, gathered)
    return jnp.einsum(equation, x, w, out_sharding=NamedSharding(mesh, out_spec))


def layer_norm(x: jax.Array, g: jax.Array, b: jax.Array, eps: float = 1e-5) -> jax.Array:
    xf = x.astype(jnp.float32)
    mu = xf.mean(-1, keepdims=True)
    var = ((xf - mu) ** 2).mean(-1, keepdims=True)
    return ((xf - mu) * jax.lax.rsqrt(var + eps)).astype(x.dtype) * g + b


def init_params(key: jax.Array, cfg: Config, mesh: Mesh) -> list[dict[str, jax.Array]]:
    """One dict per layer, each weight placed with its tensor-parallel sharding."""
    a, dt = cfg.axis, jnp.dtype(cfg.dtype)
    D, H, K, F = cfg.d_model, cfg.heads, cfg.d_head, cfg.d_ff
    layout = {"ln1_g": P(), "ln1_b": P(), "ln2_g": P(), "ln2_b": P(),
              "wqkv": P(None, None, a, None),   # [d_model, 3, heads, d_head]: column-parallel
              "wo": P(a, None, None),           # [heads, d_head, d_model]: row-parallel
              "w_up": P(None, a),               # [d_model, d_ff]: column-parallel
              "w_down": P(a, None)}             # [d_ff, d_model]: row-parallel
    layers = []
    for k in jax.random.split(key, cfg.layers):
        k1, k2, k3, k4 = jax.random.split(k, 4)
        vals = {"ln1_g": jnp.ones((D,)), "ln1_b": jnp.zeros((D,)),
                "ln2_g": jnp.ones((D,)), "ln2_b": jnp.zeros((D,)),
                "wqkv": jax.random.normal(k1, (D, 3, H, K)) / D ** 0.5,
                "wo": jax.random.normal(k2, (H, K, D)) / (H * K) ** 0.5,
                "w_up": jax.random.normal(k3, (D, F)) / D ** 0.5,
                "w_down": jax.random.normal(k4, (F, D)) / F ** 0.5}
        layers.append({n: jax.device_put(v.astype(dt), NamedSharding(mesh, layout[n])) for n, v in vals.items()})
    return layers


def block(params: dict[str, jax.Array], x: jax.Array, cfg: Config, mesh: Mesh,
          proj: Proj | None = None) -> jax.Array:
    """One pre-LN transformer block; x [batch, seq, d_model] sharded on seq, result likewise."""
    proj = proj or functools.partial(plain_proj, mesh=mesh)
    a, b = cfg.axis, cfg.batch_axis
    h = layer_norm(x, params["ln1_g"], params["ln1_b"])
    qkv = proj("bsd,dthk->bsthk", h, params["wqkv"], P(b, None, None, a, None))    # QKV
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    s = jnp.einsum("bqhk,bshk->bhqs", q, k) / jnp.sqrt(jnp.asarray(cfg.d_head, q.dtype))
    causal = jnp.tril(jnp.ones((cfg.seq, cfg.seq), dtype=bool))
    s = jnp.where(causal, s, jnp.asarray(-1e9, s.dtype))
    o = jnp.einsum("bhqs,bshk->bqhk", jax.nn.softmax(s, axis=-1), v)
    x = x + proj("bshk,hkd->bsd", o, params["wo"], P(b, a, None))                 # attention out
    h = layer_norm(x, params["ln2_g"], params["ln2_b"])
    u = jax.nn.gelu(proj("bsd,df->bsf", h, params["w_up"], P(b, None, a)))       # MLP up
    return x + proj("bsf,fd->bsd", u, params["w_down"], P(b, a, None))            # MLP down


def forward(params: list[dict[str, jax.Array]], x: jax.Array, cfg: Config, mesh: Mesh,
            proj: Proj | None = None) -> jax.Array:
    """cfg.layers blocks, unrolled (a Python loop, so each layer's projections appear once each)."""
    for layer in params:
        x = block(layer, x, cfg, mesh, proj)
    return x


def example_args(cfg: Config, mesh: Mesh, seed: int = 0) -> tuple[list[dict[str, jax.Array]], jax.Array]:
    """(params, x) with their shardings: x [batch, seq, d_model] sharded on seq."""
    kp, kx = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (cfg.batch, cfg.seq, cfg.d_model)).astype(cfg.dtype)
    x = jax.device_put(x, NamedSharding(mesh, P(cfg.batch_axis, cfg.axis, None)))
    return init_params(kp, cfg, mesh), x


def example(mesh: Mesh | None = None, layers: int = 2, dtype: str = "float32",
            proj: Proj | None = None) -> tuple[Callable[..., jax.Array], tuple[Any, ...]]:
    """(fn, args) for `autotuner extract autotuner.examples.transformer:example`: a jitted
    `layers`-layer forward on a 4-device `model` mesh (or `mesh`, whose first axis is the model
    axis) and its example arguments."""
    mesh = mesh or make_mesh(4)
    cfg = Config(layers=layers, dtype=dtype, axis=mesh.axis_names[0])
    fn = jax.jit(functools.partial(forward, cfg=cfg, mesh=mesh, proj=proj))
    return fn, example_args(cfg, mesh)


def loss(params: list[dict[str, jax.Array]], x: jax.Array, cfg: Config, mesh: Mesh,
         proj: Proj | None = None) -> jax.Array:
    """A toy objective for the training step: the mean square of the output (in float32)."""
    return (forward(params, x, cfg, mesh, proj).astype(jnp.float32) ** 2).mean()


def train_step(mesh: Mesh | None = None, layers: int = 2, dtype: str = "float32", batch: int = 2,
               seq: int = 64, d_model: int = 64, heads: int = 8, d_head: int = 8, d_ff: int = 256,
               lr: float = 0.01) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """(fn, args) of a whole training step: `fn(params, x) -> (loss, new params)`, value_and_grad of
    `loss` and an SGD update, jitted, on a 4-device `model` mesh (or `mesh`, its first axis the
    model axis). The shapes are keyword arguments, e.g. for `autotuner plan/bench-model --kwargs`.
    Its backward pass has the transposed pairs: the gradient of each row-parallel projection's
    input is gathered before its dot, that of each column-parallel one reduce-scattered after."""
    mesh = mesh or make_mesh(4)
    cfg = Config(batch=batch, seq=seq, d_model=d_model, heads=heads, d_head=d_head, d_ff=d_ff,
                 layers=layers, dtype=dtype, axis=mesh.axis_names[0])

    def step(params: list[dict[str, jax.Array]], x: jax.Array) -> tuple[jax.Array, Any]:
        value, grads = jax.value_and_grad(loss)(params, x, cfg, mesh)
        return value, jax.tree.map(lambda p, g: p - lr * g.astype(p.dtype), params, grads)

    return jax.jit(step), example_args(cfg, mesh)

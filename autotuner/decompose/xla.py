"""`xla_windowed`: the plain einsum, partitioned by GSPMD, with XLA's windowed-einsum pass on.

The program is the einsum itself with the problem's input and output shardings: GSPMD inserts
the collective (an all-gather feeding the dot, or a reduce-scatter after it), and XLA's own
"windowed einsum" / collective-matmul pass of the SPMD partitioner decomposes it into a loop of
collective-permutes and partial dots when the compile options ask for it. The options travel
with the strategy (`compiler_options`), not with the program: the harness passes them to
`jax.jit(...).lower(...).compile(compiler_options=...)`.

Option names are XLA's `DebugOptions` fields (checked in the installed jaxlib):
- GPU: `xla_gpu_threshold_for_windowed_einsum_mib` (default 100000, i.e. off; 0 windows every
  einsum) and `xla_gpu_multi_streamed_windowed_einsum` (partial dots on several streams).
- TPU (libtpu flags): `xla_tpu_enable_windowed_einsum_for_all_gather` and
  `xla_tpu_enable_windowed_einsum_for_reduce_scatter` (both on by default: XLA:TPU windows einsums
  above its size threshold in plain jit, which `plain` measures), and
  `xla_jf_spmd_threshold_for_windowed_einsum_mib` (that threshold; 0 windows every einsum, as the
  GPU option does). Checked on v5e:2x4 with libtpu 0.0.42: plain jit windows a 8x2048x4096 MLP-up
  and leaves a 4-D attention output's reduce-scatter; with these options both are windowed; with
  the first two off neither is (what the pass's analysis compiles with, `hlo.compile`).
XLA:CPU has no windowed-einsum pass: it accepts the GPU options and ignores them (the compiled
HLO keeps one all-gather and a dot), so `space` leaves the strategy out on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding

from autotuner.decompose._common import check_mesh, constrain, pspec
from autotuner.problem import Problem
from autotuner.strategy import Strategy

#: platforms whose compiler honours the options below (what `space` offers xla_windowed on)
PLATFORMS = ("gpu", "tpu")
#: platforms with a multi-stream variant
MULTI_STREAM_PLATFORMS = ("gpu",)


def compiler_options(strategy: Strategy, platform: str) -> dict[str, Any]:
    """XLA compile options for `strategy` on `platform` ({} for everything but xla_windowed)."""
    if strategy.method != "xla_windowed":
        return {}
    if platform == "tpu":  # on, and below XLA:TPU's own size threshold too
        return {"xla_tpu_enable_windowed_einsum_for_all_gather": True,
                "xla_tpu_enable_windowed_einsum_for_reduce_scatter": True,
                "xla_jf_spmd_threshold_for_windowed_einsum_mib": 0}
    # gpu, and what XLA:CPU accepts and ignores (tests check that it changes nothing there)
    opts: dict[str, Any] = {"xla_gpu_threshold_for_windowed_einsum_mib": 0}
    if strategy.multi_stream:
        opts["xla_gpu_multi_streamed_windowed_einsum"] = True
    return opts


def flags(strategy: Strategy, platform: str) -> str:
    """The environment setting that compiles a whole program with `strategy`'s options on
    `platform`: LIBTPU_INIT_ARGS on TPU, XLA_FLAGS on GPU (set before JAX starts)."""
    opts = compiler_options(strategy, platform)
    text = " ".join(f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in opts.items())
    return f"{'LIBTPU_INIT_ARGS' if platform == 'tpu' else 'XLA_FLAGS'}='{text}'"


def plain_einsum(problem: Problem, mesh: Mesh) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """The einsum with the problem's shardings, partitioned by GSPMD (no shard_map)."""
    check_mesh(problem, mesh)
    ls, rs, os_ = pspec(problem.lhs.spec), pspec(problem.rhs.spec), pspec(problem.out_spec)
    dtype = jnp.dtype(problem.dtype)
    eq = str(problem.eq)
    explicit = all(t == AxisType.Explicit for t in mesh.axis_types)
    auto = mesh if not explicit else Mesh(mesh.devices, mesh.axis_names,
                                          axis_types=(AxisType.Auto,) * len(mesh.axis_names))

    def body(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        out = jnp.einsum(eq, lhs, rhs)
        return lax.with_sharding_constraint(out, NamedSharding(auto, os_))

    def fn(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        lhs = constrain(jnp.asarray(lhs, dtype), mesh, ls)
        rhs = constrain(jnp.asarray(rhs, dtype), mesh, rs)
        if explicit:  # let GSPMD choose the collective, as it does for a plain jnp program
            return jax.sharding.auto_axes(body, out_sharding=NamedSharding(mesh, os_))(lhs, rhs)
        return body(lhs, rhs)

    return fn

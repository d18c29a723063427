"""A program built on CPU devices, re-laid on a compile-only target's devices (`aot:tpu:...`).

A factory cannot place arrays on devices that do not exist, so `autotuner plan --target aot:...`
runs it on in-process CPU devices of the same mesh shape, then `relay` moves the program over:
its arguments become abstract values (`jax.ShapeDtypeStruct`, same shape, dtype and spec) on a
mesh of the target's devices with the same axis names, sizes and types, and the function is
traced once (with the CPU arguments) into a jaxpr whose every concrete mesh (a sharding
constraint's, a jit's in/out shardings, a shard_map's) is swapped for the target's. What the
factory closed over is baked in as constants. The result is an ordinary function of the
abstract arguments that `overlap(fn).plan`/`.lower` and `jax.jit(...).lower` take.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def relay(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], devices: Sequence[Any]
          ) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any], Any]:
    """(the function, its abstract arguments and keyword arguments, the target mesh)."""
    import jax
    import numpy as np
    from jax.extend import core as jcore
    from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

    from autotuner.measure.aot import mesh_on

    leaves, tree = jax.tree.flatten((args, kwargs))
    src = next((x.sharding.mesh for x in leaves if isinstance(getattr(x, "sharding", None), NamedSharding)), None)
    if src is None:
        raise ValueError("no argument is laid out on a mesh (a NamedSharding): nothing to re-lay")
    dst = mesh_on(devices, src.axis_sizes, src.axis_names)
    dst = Mesh(dst.devices, dst.axis_names, axis_types=src.axis_types)

    abstract_src, abstract_dst = src.abstract_mesh, dst.abstract_mesh

    def moved(v: Any) -> Any:
        if isinstance(v, Mesh):
            return dst if v == src else v
        if isinstance(v, AbstractMesh):   # a context mesh, or an explicit type's mesh: names the platform
            return abstract_dst if v == abstract_src else v
        if isinstance(v, NamedSharding) and v.mesh in (src, abstract_src):
            return NamedSharding(dst if isinstance(v.mesh, Mesh) else abstract_dst, v.spec, memory_kind=v.memory_kind)
        if isinstance(v, jcore.ClosedJaxpr):
            return jcore.ClosedJaxpr(swap(v.jaxpr), [_host(c) for c in v.consts])
        if isinstance(v, jcore.Jaxpr):
            return swap(v)
        if type(v) is tuple:   # a plain tuple of shardings or jaxprs (a NamedTuple is a parameter record)
            return tuple(moved(x) for x in v)
        if type(v) is list:
            return [moved(x) for x in v]
        return v

    def aval(a: Any) -> Any:
        sh = getattr(a, "sharding", None)
        if isinstance(sh, NamedSharding) and sh.mesh == abstract_src:
            return a.update(sharding=NamedSharding(abstract_dst, sh.spec, memory_kind=sh.memory_kind))
        return a

    def context(c: Any) -> Any:
        """An equation's context (the mesh it is evaluated and lowered under) moved too. JAX has no
        public way to build one; `JaxprEqnContext._create` is its own constructor (jax 0.10.2)."""
        from jax._src.core import JaxprEqnContext

        mesh = moved(c.cur_abstract_mesh)
        if mesh is c.cur_abstract_mesh:
            return c
        meta = tuple(sorted(c.xla_metadata.items())) if c.xla_metadata else None
        return JaxprEqnContext._create(c.compute_type, c.threefry_partitionable, mesh,
                                       c.remove_size_one_mesh_axis, meta)

    def swap(jaxpr: Any) -> Any:
        """The jaxpr with every mesh moved: in its equations' parameters and in its values' types
        (an Explicit layout's type names its abstract mesh, whose device kind is the CPU's)."""
        new: dict[Any, Any] = {}

        def var(v: Any) -> Any:
            if isinstance(v, jcore.Literal):
                return jcore.Literal(v.val, aval(v.aval))
            if isinstance(v, jcore.DropVar):
                return jcore.DropVar(aval(v.aval))
            if v not in new:
                new[v] = jcore.Var(aval(v.aval))
            return new[v]

        constvars, invars = [var(v) for v in jaxpr.constvars], [var(v) for v in jaxpr.invars]
        eqns = [e.replace(invars=[var(v) for v in e.invars], outvars=[var(v) for v in e.outvars],
                          params={k: moved(p) for k, p in e.params.items()}, ctx=context(e.ctx))
                for e in jaxpr.eqns]
        return jaxpr.replace(constvars=constvars, invars=invars, eqns=eqns, outvars=[var(v) for v in jaxpr.outvars])

    def _host(c: Any) -> Any:
        return np.asarray(c) if isinstance(c, jax.Array) else c

    closed, shapes = jax.make_jaxpr(lambda *flat: fn(*jax.tree.unflatten(tree, flat)[0],
                                                      **jax.tree.unflatten(tree, flat)[1]),
                                    return_shape=True)(*leaves)
    jaxpr, consts = swap(closed.jaxpr), [_host(c) for c in closed.consts]
    out_tree = jax.tree.structure(shapes)

    def abstract(x: Any) -> Any:
        """An argument as an abstract value on the target: its layout moved with its mesh; one on
        a single device (an optimizer's step count) replicated over the target's mesh."""
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            return x
        sh = moved(getattr(x, "sharding", None))
        if not (isinstance(sh, NamedSharding) and sh.mesh in (dst, abstract_dst)):
            sh = NamedSharding(dst, PartitionSpec())
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)

    def relaid(*a: Any, **k: Any) -> Any:
        out = jax.core.eval_jaxpr(jaxpr, consts, *jax.tree.leaves((a, k)))
        return jax.tree.unflatten(out_tree, out)

    relaid.__name__ = getattr(fn, "__name__", "relaid")
    new_args, new_kwargs = jax.tree.unflatten(tree, [abstract(x) for x in leaves])
    return relaid, tuple(new_args), dict(new_kwargs), dst

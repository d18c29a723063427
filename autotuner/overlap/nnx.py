"""Flax NNX objects as arguments: `overlap` runs a step written for `nnx.jit`, one that updates the
model and optimizer it is given in place, the way `nnx.jit` does. The objects are split into their
state (`nnx.split`: arrays, which carry the layout); the pass prepares and compiles a pure function
of that state, which merges the objects back, calls the step and returns the state they then
hold; after the call the caller's objects are updated with it (`nnx.update`), and where the step
returns one of them (or a module inside one) the caller gets its own object back. Without this, any
jit of such a step drops its updates (`overlap.arguments`). Flax is imported only where an
argument is already an NNX object."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import jax

Where = tuple[int | str, ...]   # the NNX arguments' positions, and keyword names


class Same:
    """In a step's result, one of the NNX objects it was given (or a module inside one), by its path
    in their graph: the caller gets back its own object, as nnx.jit gives it (`restore`)."""

    __slots__ = ("path",)

    def __init__(self, path: tuple[Any, ...]) -> None:
        self.path = path


jax.tree_util.register_pytree_node(Same, lambda s: ((), s.path), lambda path, _: Same(path))


def _objects(objs: tuple[Any, ...]) -> dict[tuple[Any, ...], Any]:
    """Path -> each NNX object in the graph of `objs` (the objects and the modules inside them)."""
    from flax import nnx

    return {path: node for path, node in nnx.iter_graph(objs) if isinstance(node, nnx.Pytree)}


def where_objects(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Where:
    """The positions (and keyword names) of the arguments that are Flax NNX objects; () if none
    (or Flax NNX is not loaded: then none can be)."""
    if "flax.nnx" not in sys.modules:
        return ()
    from flax import nnx

    def is_object(x: Any) -> bool:   # a Module, an Optimizer, Rngs (not a State: that is arrays)
        return isinstance(x, nnx.Pytree)

    return tuple([i for i, a in enumerate(args) if is_object(a)] + [k for k, v in kwargs.items() if is_object(v)])


def split(where: Where, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, tuple[Any, ...],
                                                                                 tuple[Any, ...], dict[str, Any]]:
    """(graphdef, state, the NNX objects, the other positional and keyword arguments)."""
    from flax import nnx

    objs = tuple(args[w] if isinstance(w, int) else kwargs[w] for w in where)
    graphdef, state = nnx.split(objs)
    rest = tuple(a for i, a in enumerate(args) if i not in where)
    return graphdef, state, objs, rest, {k: v for k, v in kwargs.items() if k not in where}


def pure(fn: Callable[..., Any], graphdef: Any, where: Where, n_args: int) -> Callable[..., Any]:
    """fn as a function of the objects' state and the other arguments, returning (its result, the
    objects' state after it)."""
    def step(state: Any, *rest: Any, **kw: Any) -> tuple[Any, Any]:
        from flax import nnx

        objs = nnx.merge(graphdef, state, copy=True)   # the step updates the copies, not its argument
        it, at = iter(rest), dict(zip(where, objs, strict=True))
        args = [at[i] if i in at else next(it) for i in range(n_args)]
        out = fn(*args, **kw, **{w: o for w, o in at.items() if isinstance(w, str)})
        paths = {id(node): path for path, node in _objects(objs).items()}
        out = jax.tree.map(lambda x: Same(paths[id(x)]) if id(x) in paths else x, out,
                           is_leaf=lambda x: id(x) in paths)
        return out, nnx.state(objs)

    step.__name__ = getattr(fn, "__name__", "step")
    step.__doc__ = getattr(fn, "__doc__", None)
    return step


def update(objs: tuple[Any, ...], state: Any) -> None:
    """The caller's objects given the state the step left them in."""
    from flax import nnx

    nnx.update(objs, state)


def restore(out: Any, objs: tuple[Any, ...]) -> Any:
    """The step's result with the caller's own objects where it returned one it was given (`Same`)."""
    if not any(isinstance(x, Same) for x in jax.tree.leaves(out, is_leaf=lambda x: isinstance(x, Same))):
        return out
    nodes = _objects(objs)
    return jax.tree.map(lambda x: nodes[x.path] if isinstance(x, Same) else x, out, is_leaf=lambda x: isinstance(x, Same))

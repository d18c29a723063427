"""A traced function's arguments after the call: a jit traces the function with copies of them,
so a value it writes into them (an in-place update) never reaches the caller. `overlap` checks
and refuses such a function (`apply.Interpreter.run`) rather than run a step without its updates;
Flax NNX objects among the arguments are the exception, handled as nnx.jit does (`overlap.nnx`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax


class ArgumentsChanged(Exception):  # noqa: N818 - what the traced function did, not an error of ours
    """The traced function replaced values inside its arguments (an in-place update: an optimizer
    writing into a dict it was given, a Flax NNX state it merged and updated). Any jit traces the function
    with copies of its arguments and drops such changes, so the caller would never see them:
    `overlap` raises instead of running a step whose updates are lost."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths
        shown = ", ".join(paths[:4]) + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")
        super().__init__(
            f"the function changed its arguments in place ({shown}): a jit, this one or jax.jit, traces it "
            "with copies of its arguments and drops such changes, so every call would lose them. Return the "
            "new values instead (Flax NNX objects passed whole, a Module or an Optimizer, are the exception: "
            "overlap carries their updates back as nnx.jit does)")


def changed(before: Sequence[Any], args: Any) -> list[str]:
    """Where the leaves of `args` ((positional, keyword) arguments) are no longer `before`'s: the
    argument (`args[0]`, or a keyword's name) and the path in it."""
    after = jax.tree_util.tree_flatten_with_path(args)[0]
    if len(after) != len(before):
        return [f"{len(before)} leaves became {len(after)}"]
    out = []
    for (path, x), y in zip(after, before, strict=True):
        if x is not y:
            which, at, *rest = path   # (0: positional | 1: keyword, its index or name, the path in it)
            head = f"args[{at.idx}]" if which.idx == 0 else str(at.key)
            out.append(head + jax.tree_util.keystr(tuple(rest)))
    return out


def check_unchanged(before: Sequence[Any], args: Any) -> None:
    """Raise `ArgumentsChanged` if the leaves of `args` are no longer `before` (identity)."""
    paths = changed(before, args)
    if paths:
        raise ArgumentsChanged(paths)

"""Compile a JAX program with XLA's dumps around the SPMD partitioner and extract its problems."""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from autotuner.hlo.pairs import ExtractReport
from autotuner.hlo.problems import extract_from_hlo
from autotuner.hlo.shardings import MeshInfo
from autotuner.hlo.text import ExtractError
from autotuner.problem import Problem

log = logging.getLogger(__name__)

# -- compiling ----------------------------------------------------------------------------------------

def _leaves(tree: Any) -> list[Any]:
    import jax

    return jax.tree_util.tree_leaves(tree)


def _mesh_from_args(args: Sequence[Any], kwargs: Mapping[str, Any]) -> MeshInfo | None:
    from jax.sharding import NamedSharding

    found: MeshInfo | None = None
    for leaf in _leaves((tuple(args), dict(kwargs))):
        sh = getattr(leaf, "sharding", None)
        if isinstance(sh, NamedSharding):
            m = sh.mesh
            info = MeshInfo(tuple(m.axis_names), tuple(int(s) for s in m.axis_sizes))
            if found is not None and found != info:
                raise ExtractError(f"the example arguments use two meshes: {found.as_dict()} and "
                                   f"{info.as_dict()}; pass mesh=")
            found = info
    return found


def _mesh_info(mesh: Any) -> MeshInfo:
    if isinstance(mesh, MeshInfo):
        return mesh
    if isinstance(mesh, Mapping):
        return MeshInfo(tuple(mesh), tuple(int(v) for v in mesh.values()))
    names = getattr(mesh, "axis_names", None)
    if names is None:
        raise ExtractError(f"mesh must be a jax Mesh or a mapping axis -> size, got {type(mesh).__name__}")
    return MeshInfo(tuple(names), tuple(int(s) for s in mesh.axis_sizes))


@contextlib.contextmanager
def _dump_dir() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="autotuner-extract-") as d:
        yield d


def partitioned_hlo(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[str, str, int]:
    """(propagated, partitioned, num_partitions): the HLO text before and after XLA's SPMD
    partitioner for `fn` compiled with the example arguments. For a one-device program, where the
    partitioner does not run, both texts are ''."""
    return compile_with_hlo(fn, *args, **kwargs)[:3]


def compile_with_hlo(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[str, str, int, Any]:
    """`partitioned_hlo`'s texts and partition count, and the compiled executable
    (`jax.stages.Compiled`), so a caller that runs the program needs no second compile."""
    import jax

    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    try:
        lowered = jitted.lower(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - report what the user's function did
        raise ExtractError(f"could not lower the function with the example arguments: {e}") from e
    with _dump_dir() as d:
        opts = {"xla_dump_to": d, "xla_dump_hlo_pass_re": "spmd-partitioning",
                "xla_dump_hlo_as_text": True, "xla_dump_hlo_as_proto": False}
        try:
            compiled = lowered.compile(compiler_options=opts)
        except Exception as e:  # noqa: BLE001
            raise ExtractError(f"could not compile the function: {e}") from e
        files = sorted(glob.glob(os.path.join(d, "*.txt")))
        module = lambda f: os.path.basename(f).split(".")[0]  # noqa: E731 - module_NNNN
        before = [f for f in files if "before_spmd-partitioning" in os.path.basename(f)]
        after = [f for f in files if "after_spmd-partitioning" in os.path.basename(f)]
        both = sorted({module(f) for f in before} & {module(f) for f in after})
        if both:  # one module per compile; if XLA dumped several, the last compiled is ours
            before = [f for f in before if module(f) == both[-1]]
            after = [f for f in after if module(f) == both[-1]]
        if not before or not after:
            head = next((f for f in files if f.endswith("before_optimizations.txt")), None)
            parts = 1
            if head:
                with open(head) as fh:
                    m = re.search(r"num_partitions=(\d+)", fh.readline())
                parts = int(m.group(1)) if m else 1
            if parts > 1:
                raise ExtractError("XLA did not dump the module around spmd-partitioning (is the persistent "
                                   "compilation cache answering? set JAX_ENABLE_COMPILATION_CACHE=false)")
            return "", "", parts, compiled
        with open(before[-1]) as fh:
            pre = fh.read()
        with open(after[-1]) as fh:
            post = fh.read()
    m = re.search(r"num_partitions=(\d+)", post.split("\n", 1)[0])
    return pre, post, int(m.group(1)) if m else 1, compiled


def extract_report(fn: Callable[..., Any], *args: Any, mesh: Any = None, **kwargs: Any) -> ExtractReport:
    """Like `extract`, with the pairs that could not be mapped and why."""
    info = _mesh_info(mesh) if mesh is not None else _mesh_from_args(args, kwargs)
    pre, post, parts = partitioned_hlo(fn, *args, **kwargs)
    if parts <= 1 or not post:
        log.debug("extract: the program runs on one device: no collectives")
        return ExtractReport([], [], 0, parts, info.as_dict() if info else {})
    if info is None:
        raise ExtractError(f"the program is partitioned {parts} ways but no example argument has a "
                           "NamedSharding; pass mesh=")
    return extract_from_hlo(pre, post, info)


def extract(fn: Callable[..., Any], *args: Any, mesh: Any = None, **kwargs: Any) -> list[tuple[Problem, int]]:
    """[(Problem, count), ...] for the all-gather -> einsum and einsum -> reduce-scatter pairs of
    `fn` compiled with the example arguments (arrays or `jax.ShapeDtypeStruct`s with shardings).

    `fn` may be jitted already (static arguments then work as usual); `kwargs` go to `fn` (`mesh` is
    extract's own keyword: bind a function's own `mesh` argument with functools.partial). The mesh
    comes from the arguments' `NamedSharding`s unless `mesh` (a jax Mesh or {axis: size}) is given.
    Problems come in order of first occurrence; the same Problem key twice counts 2. Pairs that do
    not map to a Problem are skipped (logged at debug level; `extract_report` lists them).
    """
    return extract_report(fn, *args, mesh=mesh, **kwargs).problems

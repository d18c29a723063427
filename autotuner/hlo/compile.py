"""Compile a JAX program with XLA's dumps around the SPMD partitioner and extract its problems."""

from __future__ import annotations

import contextlib
import glob
import gzip
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from autotuner.files import write_atomic
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


# Options for a compile whose only product is the HLO around the partitioner (the executable is
# thrown away): the backend's code generation, most of a compile's time, at its cheapest. Per
# platform; the partitioned module does not depend on them, but on TPU: there the partitioner
# decomposes large gather/scatter einsums itself (XLA's windowed einsum, on by default above its
# size threshold), so the analysis turns that off to see every pair as a collective and a dot;
# what plain jit makes of each pair is read from a compile with the default options
# (`overlap.find.windowed_tags`).
ANALYSIS_OPTIONS: dict[str, dict[str, Any]] = {
    "tpu": {"xla_tpu_enable_windowed_einsum_for_all_gather": False,
            "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False},
    "cpu": {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True},
    "gpu": {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
            "xla_gpu_autotune_level": 0},
    "cuda": {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
             "xla_gpu_autotune_level": 0},
}
_DUMP = {"xla_dump_hlo_pass_re": "spmd-partitioning", "xla_dump_hlo_as_text": True,
         "xla_dump_hlo_as_proto": False}


def lower(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn` (jitted, or jitted here) lowered with the example arguments; ExtractError if it cannot be."""
    import jax

    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    try:
        return jitted.lower(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - report what the user's function did
        raise ExtractError(f"could not lower the function with the example arguments: {e}") from e


def _texts_cache() -> str | None:
    """Where partitioned texts are kept across processes: beside JAX's persistent compilation cache,
    when one is configured (the same switch; nothing is written otherwise)."""
    import jax

    d = jax.config.jax_compilation_cache_dir
    if not d or not jax.config.jax_enable_compilation_cache:
        return None
    return os.path.join(str(d), "autotuner-partitioned")


def _cache_key(lowered: Any, opts: Mapping[str, Any]) -> str:
    import jax
    import jaxlib

    h = hashlib.sha256(lowered.as_text().encode())
    h.update(repr((jax.__version__, jaxlib.__version__, sorted(opts.items()))).encode())
    return h.hexdigest()


@dataclass(frozen=True)
class Partitioned:
    """A lowered program's HLO text before and after XLA's SPMD partitioner (both '' for a
    one-device program, where it does not run), its partition count, the compiled program's temp
    (scratch) bytes per device (`temp_bytes`; an analysis compile may still be finishing them, see
    `partitioned_texts`), and the executable where one was compiled to run."""

    pre: str
    post: str
    parts: int
    temp: int | None | Future[int | None]
    compiled: Any
    kept: str = ""   # with a persistent cache: where these texts are kept (a path without its
    #                  suffix), beside which what is read from them may be kept too ('' otherwise)

    @property
    def temp_bytes(self) -> int | None:
        """The temp bytes per device (None where not known), waiting for the analysis if needed."""
        if not isinstance(self.temp, Future):
            return self.temp
        try:
            return self.temp.result()
        except Exception as e:  # noqa: BLE001 - the texts were read; only the bytes are missing
            log.warning("the analysis compile failed after the partitioner (%s); temp memory unknown", e)
            return None


def temp_bytes(compiled: Any) -> int | None:
    """The compiled program's temp (scratch) bytes per device, where the backend says."""
    try:
        return int(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - a backend without memory analysis
        return None


# A program traced for analysis only may end in this custom call (`analysis_stop`), whose target
# nothing registers: the backend then stops its compile where it emits the call's code, after the
# partitioner's dumps and the buffer assignment (the temp bytes) and before code generation, most
# of a compile's time. Per platform, where that order is checked (tests/autotuner/overlap/test_pass_cost.py).
STOP_TARGET = "autotuner_analysis_stop"
STOP_PLATFORMS = frozenset({"cpu"})


def platform_of(platform: str | None = None) -> str:
    """`platform`, else this process's default backend's (a compile-only target's programs name
    theirs: the pass passes its mesh's)."""
    if platform:
        return platform
    import jax

    return str(jax.devices()[0].platform)


def stops_here(platform: str | None = None) -> bool:
    """Whether this backend's analysis compiles can end at `analysis_stop`."""
    return platform_of(platform) in STOP_PLATFORMS


def analysis_stop() -> Any:
    """Called inside a function being traced, a scalar to return beside its outputs: the custom
    call that ends an analysis compile before code generation (`partitioned_texts(stops=True)`).
    The program is then never run; its other outputs, and so the partitioned HLO, are unchanged."""
    import jax
    import jax.numpy as jnp

    return jax.ffi.ffi_call(STOP_TARGET, jax.ShapeDtypeStruct((), jnp.float32))()


def _dumped_temp(d: str, module: str) -> int | None:
    """The temp bytes per device of `module`'s dumped buffer assignment: its preallocated-temp
    allocations (what `memory_analysis().temp_size_in_bytes` sums), None without the dump."""
    files = glob.glob(os.path.join(d, f"{module}.*buffer-assignment.txt"))
    if not files:
        return None
    total = 0
    with open(files[0]) as fh:
        for line in fh:
            m = re.match(r"allocation \d+: size (\d+),.*preallocated-temp", line)
            if m:
                total += int(m.group(1))
    return total


def partitioned_texts(lowered: Any, *, analysis: bool = False, stops: bool = False,
                      platform: str | None = None) -> Partitioned:
    """A lowered program's `Partitioned`. `analysis=True`: the texts (and temp bytes: the buffer
    assignment does not depend on code generation) are all that is wanted, so the backend
    compiles at its cheapest (`ANALYSIS_OPTIONS`) and `compiled` is None (not fit to run).
    `stops=True` (with `analysis`): the program returns `analysis_stop()`, so the compile ends
    before code generation and the temp bytes come from the dumped buffer assignment. With
    JAX's persistent compilation cache configured the texts are kept beside it, so the same
    program analysed again (a restarted job) is not compiled for them. `platform`: the one the
    program is compiled for (default this process's backend)."""
    cheap = dict(ANALYSIS_OPTIONS.get(platform_of(platform), {}))
    cache = _texts_cache()
    key = _cache_key(lowered, cheap) if cache else ""
    texts = _load(cache, key) if cache else None
    if texts is None and analysis and stops and cache is None:
        return _early_texts(lowered, cheap)
    if texts is None:
        # With a persistent cache the texts come from a cheap compile of their own, so that the
        # executable is compiled (below) exactly as a later run will look it up in JAX's cache.
        # The dump needs XLA to compile, not the persistent cache to answer.
        dump_only = analysis or cache is not None
        with tempfile.TemporaryDirectory(prefix="autotuner-extract-") as d, _no_persistent_cache():
            opts = {**(cheap if dump_only else {}), **_DUMP, "xla_dump_to": d}
            compiled = _compile(lowered, opts, stops=stops and analysis)
            pre, post, parts, module = _read_dump(d)
            temp = temp_bytes(compiled) if compiled is not None else _dumped_temp(d, module)
            texts = (pre, post, parts, temp)
        if cache:
            _store(cache, key, *texts)
        if not dump_only:
            return Partitioned(*texts, compiled)
    kept = os.path.join(cache, key) if cache else ""
    return Partitioned(*texts, None if analysis else _compile(lowered, {}), kept)


def _early_texts(lowered: Any, opts: Mapping[str, Any]) -> Partitioned:
    """A stopped analysis compile whose texts are read as soon as the partitioner has dumped them:
    the compile runs in a thread (XLA releases the GIL) and goes on, through the optimization
    passes to the buffer assignment, while the caller reads the texts and rewrites the program;
    `temp_bytes` waits for it. About half of a stopped compile comes after the partitioner."""
    d = tempfile.mkdtemp(prefix="autotuner-extract-")
    fut: Future[int | None] = Future()
    read = threading.Event()

    def work() -> None:
        try:
            _compile(lowered, {**opts, **_DUMP, "xla_dump_to": d}, stops=True)
            fut.set_result(_dumped_temp(d, _dumped_module(d)))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits for the bytes
            fut.set_exception(e)
        finally:
            read.wait()   # the caller reads the texts from `d` first
            shutil.rmtree(d, ignore_errors=True)

    threading.Thread(target=work, name="autotuner-analysis").start()
    try:
        while not fut.done() and not _dumped_whole(d):
            time.sleep(0.005)
        if fut.done() and fut.exception() is not None and not _dumped_whole(d):
            raise fut.exception()  # type: ignore[misc]
        pre, post, parts, _ = _read_dump(d)
    finally:
        read.set()
    return Partitioned(pre, post, parts, fut, None)


def _dumped_module(d: str) -> str:
    """The module_NNNN prefix of the dumps in `d` ('' if none)."""
    files = sorted(glob.glob(os.path.join(d, "*.txt")))
    return os.path.basename(files[-1]).split(".")[0] if files else ""


def _dumped_whole(d: str) -> bool:
    """Whether the partitioned module is dumped in `d`, whole: XLA writes a dump as it goes, and
    prints the ENTRY computation last, so a file that has it and ends with a computation's
    closing brace is complete."""
    files = [f for f in glob.glob(os.path.join(d, "*spmd-partitioning*.txt")) if _AFTER.search(os.path.basename(f))]
    if not files:
        return False
    try:
        with open(files[0], "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 4))
            if not fh.read().rstrip(b"\n").endswith(b"\n}"):
                return False
            fh.seek(0)
            return b"\nENTRY " in fh.read()
    except OSError:
        return False


@contextlib.contextmanager
def _no_persistent_cache() -> Iterator[None]:
    """JAX's persistent compilation cache off for one compile (a hit would compile nothing, and so
    dump nothing). JAX remembers once per process whether the cache is used, so that memo is reset
    on the way in and out (`compilation_cache.reset_cache`; checked with jax 0.10.2)."""
    from jax._src import compilation_cache, config

    compilation_cache.reset_cache()
    try:
        with config.enable_compilation_cache(False):
            yield
    finally:
        compilation_cache.reset_cache()


def _load(cache: str, key: str) -> tuple[str, str, int, int | None] | None:
    path = os.path.join(cache, key + ".json.gz")
    try:
        with gzip.open(path, "rt") as fh:
            got = json.load(fh)
        temp = got.get("temp_bytes")
        return str(got["pre"]), str(got["post"]), int(got["parts"]), None if temp is None else int(temp)
    except Exception:  # noqa: BLE001 - any byte string (truncated gzip: EOFError, zlib.error) is a miss
        return None


def _compile(lowered: Any, opts: Mapping[str, Any], *, stops: bool = False) -> Any:
    """The executable; `stops`: `lowered` returns `analysis_stop()`, so the backend is expected
    to stop at its custom call (None then, the executable if it compiled it after all)."""
    try:
        return lowered.compile(compiler_options=dict(opts)) if opts else lowered.compile()
    except Exception as e:  # noqa: BLE001
        if stops and STOP_TARGET in str(e):
            return None
        raise ExtractError(f"could not compile the function: {e}") from e


def _store(cache: str, key: str, pre: str, post: str, parts: int, temp: int | None) -> None:
    keep_json(os.path.join(cache, key + ".json.gz"),
              {"pre": pre, "post": post, "parts": parts, "temp_bytes": temp}, "the partitioned texts")


def keep_json(path: str, doc: Any, what: str) -> None:
    """`doc` as JSON at `path` (gzipped when it ends in .gz), whole or not at all and fsynced
    (`files.write_atomic`). A cache that cannot be written is no reason to fail: a warning names
    `what` was not kept."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        data = json.dumps(doc).encode("utf-8")
        write_atomic(path, gzip.compress(data, mtime=0) if path.endswith(".gz") else data)
    except OSError as e:
        log.warning("could not keep %s in %s: %s", what, path, e)


# the partitioner's dumps: XLA:CPU/GPU name the pass spmd-partitioning, XLA:TPU tpu-spmd-partitioning
_BEFORE = re.compile(r"before_(?:tpu-)?spmd-partitioning")
_AFTER = re.compile(r"after_(?:tpu-)?spmd-partitioning")


def _read_dump(d: str) -> tuple[str, str, int, str]:
    """(pre, post, num_partitions, module) of the program dumped in `d`; module: its dump name
    (module_NNNN), the prefix of its other dumps."""
    files = sorted(glob.glob(os.path.join(d, "*.txt")))
    module = lambda f: os.path.basename(f).split(".")[0]  # noqa: E731 - module_NNNN
    before = [f for f in files if _BEFORE.search(os.path.basename(f))]
    after = [f for f in files if _AFTER.search(os.path.basename(f))]
    both = sorted({module(f) for f in before} & {module(f) for f in after})
    if both:  # one module per compile; if XLA dumped several, the last compiled is ours
        before = [f for f in before if module(f) == both[-1]]
        after = [f for f in after if module(f) == both[-1]]
    if not files:
        raise ExtractError("XLA dumped nothing: the program was not compiled (did a compilation cache answer?)")
    if not before or not after:
        head = next((f for f in files if f.endswith("before_optimizations.txt")), None)
        parts = 1
        if head:
            with open(head) as fh:
                m = re.search(r"num_partitions=(\d+)", fh.readline())
            parts = int(m.group(1)) if m else 1
        if parts > 1:
            raise ExtractError("XLA did not dump the module around spmd-partitioning")
        return "", "", parts, module(head) if head else ""
    with open(before[-1]) as fh:
        pre = fh.read()
    with open(after[-1]) as fh:
        post = fh.read()
    m = re.search(r"num_partitions=(\d+)", post.split("\n", 1)[0])
    return pre, post, int(m.group(1)) if m else 1, module(after[-1])


def partitioned_hlo(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[str, str, int]:
    """(propagated, partitioned, num_partitions): the HLO text before and after XLA's SPMD
    partitioner for `fn` compiled with the example arguments (at the backend's cheapest: only the
    texts are kept). For a one-device program, where the partitioner does not run, both are ''."""
    got = partitioned_texts(lower(fn, *args, **kwargs), analysis=True, platform=_platform_of_args(args, kwargs))
    return got.pre, got.post, got.parts


def _platform_of_args(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | None:
    """The platform of the devices the arguments are laid out on (a compile-only target's
    abstract arguments name theirs), None where none says."""
    for leaf in _leaves((tuple(args), dict(kwargs))):
        mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
        devices = getattr(mesh, "devices", None)
        if devices is not None and getattr(devices, "size", 0):
            return str(devices.flat[0].platform)
    return None


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

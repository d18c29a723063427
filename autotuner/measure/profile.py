"""Where a step's time goes, from XLA's own timings: the thunks XLA:CPU ran (recorded by
`jax.profiler` when the program is compiled with ``xla_cpu_enable_xprof_traceme``), split into
collectives and compute, per step (from the executable's launch to the executor's completion): how long each kind kept
this process busy, how much of the
collectives' time ran beside compute (overlap), and how long neither ran (waiting: on another
process, on the link). `profile_steps` traces calls of a compiled program; `summarize` reads the
trace (pure). `bench-model --profile` prints both programs' summaries side by side.
"""

from __future__ import annotations

import glob
import re
import statistics
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["COMPILE_OPTIONS", "StepProfile", "profile_steps", "summarize"]

COMPILE_OPTIONS = {"xla_cpu_enable_xprof_traceme": True}   # XLA:CPU records each thunk it runs
# thunks are named after their HLO instruction: XLA's own collectives by opcode, those a program
# writes with jax.lax by the primitive (a ring's `ppermute`)
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all",
               "collective-broadcast", "ppermute", "psum", "all_gather", "psum_scatter", "reduce_scatter",
               "all_to_all")
# thunks that only wrap others (their children are recorded too) and the runtime's own events
_WRAPPERS = ("while", "conditional", "call", "sequential")
_NOT_THUNK = re.compile(r"::|^end: |^\[|^Wait|^Rendezvous|^InvokeRendezvous|^Thread|^Handle |^Allocate|"
                        r"^ThreadpoolListener|^\$|^Pjit|^Parse")
_SUFFIX = re.compile(r"(\.\d+)+$|-(start|done)$")


def _kind(name: str) -> str | None:
    """'collective', 'compute', or None (not a thunk, or one that only wraps others)."""
    if _NOT_THUNK.search(name):
        return None
    base = _SUFFIX.sub("", _SUFFIX.sub("", name))
    if base in _WRAPPERS:
        return None
    return "collective" if base in COLLECTIVES else "compute"


def _union(iv: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(iv: list[tuple[int, int]]) -> int:
    return sum(b - a for a, b in iv)


def _intersect(x: list[tuple[int, int]], y: list[tuple[int, int]]) -> int:
    i = j = total = 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0, b - a)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


@dataclass
class StepProfile:
    """Per step, means over the traced steps (ms; means, so that step = collective + compute -
    overlap + idle holds for them as for each step): ``step`` the executable's run, ``collective``
    and ``compute`` the time this process had at least one thunk of that kind running,
    ``overlap`` both at once, ``idle`` neither; ``by_collective`` each collective kind's busy time."""

    steps: int
    step_ms: float
    collective_ms: float
    compute_ms: float
    overlap_ms: float
    idle_ms: float
    by_collective: dict[str, float] = field(default_factory=dict)


_LAUNCH = re.compile(r"CommonPjRtLoadedExecutable::Execute(HelperOnSingleDevice\b| \()")
_DONE = "ThunkExecutor::Execute (wait for completion)"


def _steps(events: list[tuple[str, str, int, int]]) -> list[tuple[int, int]]:
    """Each run of the executable: from its launch (on the calling thread; per device with
    several) to the executor's first completion marker after it (on the device's thread)."""
    marks = sorted((a, name == _DONE, max(a, b)) for _, name, a, b in events
                   if name == _DONE or _LAUNCH.search(name))
    out, start = [], None
    for a, done, b in marks:
        if not done:
            start = a if start is None else start
        elif start is not None:
            out.append((start, b))
            start = None
    return out


def summarize(events: Iterable[tuple[str, str, int, int]]) -> StepProfile | None:
    """`events`: (thread, name, start_ns, end_ns) of one process's trace. None if no step ran."""
    evs = sorted(events, key=lambda e: e[2])
    steps = _steps(evs)
    if not steps:
        return None
    rows = []
    for a, b in steps:
        coll: list[tuple[int, int]] = []
        comp: list[tuple[int, int]] = []
        kinds: dict[str, list[tuple[int, int]]] = {}
        for _, name, s, e in evs:
            if e <= a or s >= b:
                continue
            k = _kind(name)
            if k is None:
                continue
            iv = (max(s, a), min(e, b))
            (coll if k == "collective" else comp).append(iv)
            if k == "collective":
                kinds.setdefault(_SUFFIX.sub("", _SUFFIX.sub("", name)), []).append(iv)
        cu, pu = _union(coll), _union(comp)
        both = _intersect(cu, pu)
        busy = _length(cu) + _length(pu) - both
        rows.append((b - a, _length(cu), _length(pu), both, (b - a) - busy,
                     {k: _length(_union(v)) for k, v in kinds.items()}))
    med = [statistics.fmean(r[i] for r in rows) / 1e6 for i in range(5)]
    names = {k for r in rows for k in r[5]}
    by = {k: statistics.fmean(r[5].get(k, 0) for r in rows) / 1e6 for k in sorted(names)}
    return StepProfile(len(rows), *med, by_collective=by)


def profile_steps(run: Callable[[], Any], steps: int, *, trace: bool = True) -> StepProfile | None:
    """Call `run` (a compiled program, compiled with `COMPILE_OPTIONS`) `steps` times under
    `jax.profiler` and summarize this process's thunks; `trace=False` only runs them (the other
    processes of a multi-process step, which must call in lockstep)."""
    import jax

    if not trace:
        for _ in range(steps):
            jax.block_until_ready(run())
        return None
    from jax._src.lib import _profile_data

    opts = jax.profiler.ProfileOptions()
    opts.host_tracer_level = 3
    opts.python_tracer_level = 0
    with tempfile.TemporaryDirectory(prefix="autotuner-profile-") as d:
        with jax.profiler.trace(d, profiler_options=opts):
            for _ in range(steps):
                jax.block_until_ready(run())
        files = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
        if not files:
            return None
        data = _profile_data.ProfileData.from_file(files[0])
        events = [(line.name, e.name, e.start_ns, e.end_ns) for plane in data.planes
                  if plane.name == "/host:CPU" for line in plane.lines for e in line.events]
    return summarize(events)

"""The measurement harness: compile, check numerics, warm up, time, summarize.

The only module that times anything. A `Runner` owns the compiled programs of one problem on one
mesh and times one program for one repetition; `LocalRunner` does it in this process (in-process
devices, or one process of the lab, where `sync` aligns the processes), the lab's parent side
forwards the same calls to the lab (see `autotuner.lab_runner`). `run_session` drives a runner:
baseline and candidates in one session, repetitions interleaved, robust summaries, the ratio to
baseline with a bootstrap confidence interval, the bound max(T_comm, T_comp) + fill and the
overlap efficiency (T_base - T) / (T_base - T_bound).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np

from .problem import Problem
from .strategy import CHUNKS, Strategy
from .testing import TOLERANCE

COMM, COMP = "comm", "comp"  # program ids of the collective alone and the einsum alone


@dataclass(frozen=True)
class Summary:
    median: float
    iqr: float
    min: float
    n: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> Summary:
        a = np.asarray(samples, dtype=np.float64)
        if a.size == 0:
            return cls(math.nan, math.nan, math.nan, 0)
        q1, med, q3 = np.percentile(a, [25, 50, 75])
        return cls(float(med), float(q3 - q1), float(a.min()), int(a.size))


def ratio_ci(base: Sequence[float], cand: Sequence[float], *, level: float = 0.95,
             boot: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """median(base) / median(cand) with a bootstrap CI, resampling the paired repetitions."""
    b, c = np.asarray(base, np.float64), np.asarray(cand, np.float64)
    k = min(b.size, c.size)
    if k == 0:
        return math.nan, math.nan, math.nan
    b, c = b[:k], c[:k]
    point = float(np.median(b) / np.median(c))
    if k < 3:
        return point, math.nan, math.nan
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, k, size=(boot, k))
    rs = np.median(b[idx], axis=1) / np.median(c[idx], axis=1)
    lo, hi = np.percentile(rs, [100 * (1 - level) / 2, 100 * (1 + level) / 2])
    return point, float(lo), float(hi)


def bound(t_comm: float, t_comp: float, n: int) -> float:
    """What perfect overlap could reach: max(T_comm, T_comp) plus the pipeline's fill, the smaller
    of one ring step's transfer (T_comm/(n-1)) and one step's einsum (T_comp/n), at the finest
    chunking the space offers (a pipeline stage is a shard split in max(CHUNKS) pieces)."""
    if n <= 1:
        return t_comp
    return max(t_comm, t_comp) + min(t_comm / (n - 1), t_comp / n) / max(CHUNKS)


def efficiency(t_base: float, t: float, t_bound: float) -> float | None:
    """(T_base - T) / (T_base - T_bound): 0 is no gain, 1 is perfect overlap. T_comm is the
    library's collective alone (gloo's, NCCL's), so a value above 1 means the ring's own
    transfers beat that collective (on the lab's `ring` topology gloo's reduce-scatter took 115 ms
    where the whole ring decomposition took 82: its transfers go only to ring neighbours), not
    that the overlap beat physics."""
    if not (t_base - t_bound) > 0 or math.isnan(t):
        return None
    return (t_base - t) / (t_base - t_bound)


@dataclass
class Candidate:
    strategy: dict[str, Any]
    key: str
    status: str = "ok"                 # ok | failed
    reason: str | None = None
    compile_s: float | None = None
    memory: dict[str, int] | None = None
    error: float | None = None         # relative error against the baseline's result
    samples: list[float] = field(default_factory=list)
    median_s: float | None = None
    iqr_s: float | None = None
    min_s: float | None = None
    n: int = 0
    ratio: float | None = None         # baseline / this (> 1 is faster than baseline)
    ratio_lo: float | None = None
    ratio_hi: float | None = None
    efficiency: float | None = None
    pruned: bool = False               # timing stopped early by the tuner's pruner

    def fail(self, reason: str) -> None:
        self.status, self.reason = "failed", reason

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SessionResult:
    problem: dict[str, Any]
    baseline: Candidate
    candidates: list[Candidate]
    comm_s: float | None
    comp_s: float | None
    bound_s: float | None
    reps: int
    seconds: float

    def ok(self) -> list[Candidate]:
        return [c for c in [self.baseline, *self.candidates] if c.status == "ok"]

    def best(self) -> Candidate:
        """The fastest ok candidate by median (the baseline if nothing beats it)."""
        return min(self.ok(), key=lambda c: c.median_s if c.median_s is not None else math.inf,
                   default=self.baseline)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["baseline"] = self.baseline.to_dict()
        d["candidates"] = [c.to_dict() for c in self.candidates]
        return d


class Runner(Protocol):
    def prepare(self, problem: Problem, strategies: Sequence[Strategy], parts: bool = True
                ) -> list[dict[str, Any]]:
        """Build and compile the baseline (index 0 must be it), the candidates and the parts;
        check each candidate's numbers against the baseline; warm up. One status dict per
        strategy: {"ok", "reason", "compile_s", "memory", "rel_error"}; plus parts' status."""
        ...

    def time(self, program: int | str) -> float:
        """One repetition of one prepared program (an index, COMM or COMP), seconds, max over
        processes. Raises on failure."""
        ...


class Sync(Protocol):
    def barrier(self) -> None: ...
    def max_over_processes(self, value: float) -> float: ...


class NoSync:
    def barrier(self) -> None:
        pass

    def max_over_processes(self, value: float) -> float:
        return value


def _memory(compiled: Any) -> dict[str, int] | None:
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        return None
    if m is None:
        return None
    keys = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
            "generated_code_size_in_bytes", "alias_size_in_bytes")
    return {k: int(getattr(m, k)) for k in keys if hasattr(m, k)}


def _local_value(x: Any) -> float:
    """A replicated scalar's value on this process (works for multi-process arrays)."""
    return float(np.asarray(x.addressable_data(0)))


class LocalRunner:
    """Compiles and times in this process over `mesh` (all processes of a lab run one each)."""

    def __init__(self, mesh: Any, sync: Sync | None = None, *, warmup: int = 2, seed: int = 0,
                 max_run_s: float = 30.0):
        self.mesh, self.sync = mesh, sync or NoSync()
        self.warmup, self.seed, self.max_run_s = warmup, seed, max_run_s
        self.programs: dict[int | str, tuple[Callable, tuple]] = {}

    def _arrays(self, problem: Problem, lhs_spec, rhs_spec) -> tuple[Any, Any]:
        import jax
        from jax.sharding import NamedSharding

        from .strategies._common import pspec
        from .testing import inputs

        a, b = inputs(problem, self.seed)
        out = []
        for x, spec in ((a, lhs_spec), (b, rhs_spec)):
            sh = NamedSharding(self.mesh, pspec(spec))
            out.append(jax.make_array_from_callback(x.shape, sh, lambda idx, x=x: x[idx]))
        return out[0], out[1]

    def _compile(self, fn: Callable, args: tuple, options: dict[str, Any] | None = None
                 ) -> tuple[Callable, float, dict | None]:
        """jit, lower and compile `fn` for `args`; `options` are XLA compile options (a strategy's
        `compiler_options`, e.g. XLA's windowed einsum), passed for this compile only."""
        import jax

        t0 = time.perf_counter()
        lowered = jax.jit(fn).lower(*args)
        compiled = lowered.compile(compiler_options=options) if options else lowered.compile()
        return compiled, time.perf_counter() - t0, _memory(compiled)

    @property
    def platform(self) -> str:
        return str(self.mesh.devices.flat[0].platform)

    def _run(self, fn: Callable, args: tuple) -> Any:
        import jax

        out = fn(*args)
        jax.block_until_ready(out)
        return out

    def begin(self, problem: Problem) -> None:
        """Start a problem: inputs on the mesh, no programs yet."""
        import jax
        import jax.numpy as jnp

        self.problem = problem
        self.programs.clear()
        self.ref = None
        self.args = self._arrays(problem, problem.lhs.spec, problem.rhs.spec)
        self.err_fn = jax.jit(lambda c, b: jnp.max(jnp.abs(c.astype(jnp.float32) - b.astype(jnp.float32)))
                              / jnp.maximum(jnp.max(jnp.abs(b.astype(jnp.float32))), 1e-30))

    def add(self, index: int, strategy: Strategy) -> dict[str, Any]:
        """Compile one strategy, check it against the baseline (index 0, added first), warm up."""
        from .strategies import build, compiler_options

        problem, args = self.problem, self.args
        st: dict[str, Any] = {"ok": False, "reason": None, "compile_s": None, "memory": None, "rel_error": None}
        try:
            compiled, st["compile_s"], st["memory"] = self._compile(
                build(problem, strategy, self.mesh), args, compiler_options(strategy, self.platform))
            out = self._run(compiled, args)
            if index == 0:
                self.ref = out
                st["rel_error"] = 0.0
            else:
                if self.ref is None:
                    raise RuntimeError("the baseline failed, nothing to check against")
                st["rel_error"] = _local_value(self.err_fn(out, self.ref))
                tol = 2 * TOLERANCE[problem.dtype]
                if not st["rel_error"] <= tol:
                    raise ArithmeticError(f"numerics mismatch: relative error {st['rel_error']:.3g} "
                                          f"against the baseline (tolerance {tol:g})")
            for _ in range(self.warmup):
                t0 = time.perf_counter()
                self._run(compiled, args)
                if time.perf_counter() - t0 > self.max_run_s:
                    raise TimeoutError(f"one run took more than {self.max_run_s:g} s")
            self.programs[index] = (compiled, args)
            st["ok"] = True
        except Exception as e:  # noqa: BLE001 - a failed candidate is a result, not a crash
            st["reason"] = f"{type(e).__name__}: {e}"[:2000]
        return st

    def add_parts(self) -> None:
        """Compile the collective alone and the einsum alone (for the bound)."""
        from .strategies import build_parts

        problem = self.problem
        if problem.pattern.kind == "none":
            return
        comm, comp = build_parts(problem, self.mesh)
        comp_args = self._arrays(problem, *self._comp_specs(problem))
        for key, fn, a in ((COMM, comm, self.args), (COMP, comp, comp_args)):
            compiled, _, _ = self._compile(fn, a)
            for _ in range(max(self.warmup, 1)):
                self._run(compiled, a)
            self.programs[key] = (compiled, a)

    def prepare(self, problem: Problem, strategies: Sequence[Strategy], parts: bool = True
                ) -> list[dict[str, Any]]:
        self.begin(problem)
        statuses = [self.add(i, s) for i, s in enumerate(strategies)]
        if parts:
            self.add_parts()
        return statuses

    @staticmethod
    def _comp_specs(problem: Problem) -> tuple[list, list]:
        ls, rs = list(problem.lhs.spec), list(problem.rhs.spec)
        pat = problem.pattern
        if pat.kind == "all_gather":
            spec, letters = (ls, problem.eq.lhs) if pat.operand == "lhs" else (rs, problem.eq.rhs)
            i = letters.index(pat.letter)
            spec[i] = spec[i][:-1]
        return ls, rs

    def time(self, program: int | str) -> float:
        fn, args = self.programs[program]
        self.sync.barrier()
        t0 = time.perf_counter()
        self._run(fn, args)
        return self.sync.max_over_processes(time.perf_counter() - t0)


def run_session(runner: Runner, problem: Problem, strategies: Sequence[Strategy], *, reps: int = 7,
                log: Callable[[str], None] | None = None,
                on_rep: Callable[[int, int], None] | None = None,
                prune: Callable[[int, Candidate, Candidate, int], bool] | None = None,
                parts: bool = True) -> SessionResult:
    """Measure `strategies` (the baseline is added first if missing) in one interleaved session.

    `parts=False` skips timing the collective and the einsum alone (no bound then; a tuner
    needs them once per problem, not once per batch).
    `prune(index, candidate, baseline, reps_done)` is asked after every repetition from the third
    on; when it says True the candidate's timing stops there (its samples so far are kept).
    """
    t_start = time.perf_counter()
    strategies = list(strategies)
    if not strategies or not strategies[0].is_baseline:
        strategies = [Strategy.baseline()] + [s for s in strategies if not s.is_baseline]
    cands = [Candidate(s.to_dict(), s.key) for s in strategies]
    for c, st in zip(cands, runner.prepare(problem, strategies, parts), strict=True):
        c.compile_s, c.memory, c.error = st.get("compile_s"), st.get("memory"), st.get("rel_error")
        if not st["ok"]:
            c.fail(st["reason"] or "failed")
            if log:
                log(f"  {c.key}: failed: {c.reason}")
    base = cands[0]
    has_parts = parts and problem.pattern.kind != "none" and base.status == "ok"
    live = [i for i, c in enumerate(cands) if c.status == "ok"]
    comm: list[float] = []
    comp: list[float] = []
    for r in range(reps):
        # interleave: rotate the order every repetition so no program always runs first
        order: list[int | str] = live[r % len(live):] + live[: r % len(live)] if live else []
        if has_parts:
            order += [COMM, COMP] if r % 2 == 0 else [COMP, COMM]
        for prog in order:
            if isinstance(prog, int) and (cands[prog].status != "ok" or cands[prog].pruned):
                continue
            try:
                t = runner.time(prog)
            except Exception as e:  # noqa: BLE001
                if isinstance(prog, int):
                    cands[prog].fail(f"{type(e).__name__} while timing: {e}"[:2000])
                    if log:
                        log(f"  {cands[prog].key}: failed: {cands[prog].reason}")
                    continue
                has_parts = False
                comm, comp = [], []
                continue
            if prog == COMM:
                comm.append(t)
            elif prog == COMP:
                comp.append(t)
            else:
                cands[prog].samples.append(t)
        if prune and r + 1 >= 3 and base.status == "ok":
            for i in live[1:]:
                c = cands[i]
                if c.status == "ok" and not c.pruned and prune(i, c, base, r + 1):
                    c.pruned = True
                    if log:
                        log(f"  {c.key}: pruned after {r + 1} repetitions")
        if on_rep:
            on_rep(r + 1, reps)
    for c in cands:
        if c.status == "ok":
            s = Summary.of(c.samples)
            c.median_s, c.iqr_s, c.min_s, c.n = s.median, s.iqr, s.min, s.n
    t_comm = Summary.of(comm).median if comm else None
    t_comp = Summary.of(comp).median if comp else None
    t_bound = bound(t_comm, t_comp, problem.axis_size) if t_comm is not None and t_comp is not None else None
    for c in cands:
        if c.status != "ok" or base.status != "ok":
            continue
        c.ratio, lo, hi = ratio_ci(base.samples, c.samples)
        c.ratio_lo = None if math.isnan(lo) else lo
        c.ratio_hi = None if math.isnan(hi) else hi
        if t_bound is not None and base.median_s is not None and c.median_s is not None:
            c.efficiency = efficiency(base.median_s, c.median_s, t_bound)
    return SessionResult(problem.to_dict(), base, cands[1:], t_comm, t_comp, t_bound, reps,
                         time.perf_counter() - t_start)

"""`LocalRunner`: compiles, checks and times one problem's programs in this process
(in-process devices, or one process of the lab, where `sync` aligns the processes)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from autotuner.measure.session import COMM, COMP, NoSync, Sync
from autotuner.problem import GroupedProblem, Problem
from autotuner.strategy import Strategy
from autotuner.testing import TOLERANCE


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

    estimates = False   # it times programs that run

    def __init__(self, mesh: Any, sync: Sync | None = None, *, warmup: int = 2, seed: int = 0,
                 max_run_s: float = 30.0):
        self.mesh, self.sync = mesh, sync or NoSync()
        self.warmup, self.seed, self.max_run_s = warmup, seed, max_run_s
        self.programs: dict[int | str, tuple[Callable, tuple]] = {}

    def _arrays(self, problem: Problem, lhs_spec, rhs_spec) -> tuple[Any, Any]:
        from autotuner.testing import inputs

        a, b = inputs(problem, self.seed)
        out = self._place((a, b), (lhs_spec, rhs_spec))
        return out[0], out[1]

    def _place(self, arrays: Sequence[Any], specs: Sequence[Any]) -> tuple[Any, ...]:
        """Host arrays laid out on the mesh as `specs` say."""
        import jax
        from jax.sharding import NamedSharding

        from autotuner.decompose._common import pspec

        out = []
        for x, spec in zip(arrays, specs, strict=True):
            sh = NamedSharding(self.mesh, pspec(spec))
            out.append(jax.make_array_from_callback(x.shape, sh, lambda idx, x=x: x[idx]))
        return tuple(out)

    def _group_arrays(self, gp: GroupedProblem, specs: Sequence[Any]) -> tuple[Any, ...]:
        """A grouped problem's `(x, w_1, ..., w_k)` (`autotuner.testing.group_inputs`) laid out as `specs`."""
        from autotuner.testing import group_inputs

        return self._place(group_inputs(gp, self.seed), specs)

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
        if isinstance(problem, GroupedProblem):
            self.args = self._group_arrays(problem, [problem.gathered.spec, *[w.spec for w in problem.weights()]])
        else:
            self.args = self._arrays(problem, problem.lhs.spec, problem.rhs.spec)

        def rel(c: Any, b: Any) -> Any:
            return (jnp.max(jnp.abs(c.astype(jnp.float32) - b.astype(jnp.float32)))
                    / jnp.maximum(jnp.max(jnp.abs(b.astype(jnp.float32))), 1e-30))

        # the worst result's relative error (a grouped problem's results are a tuple)
        self.err_fn = jax.jit(lambda c, b: jnp.max(jnp.stack(jax.tree.leaves(jax.tree.map(rel, c, b)))))

    def add(self, index: int, strategy: Strategy) -> dict[str, Any]:
        """Compile one strategy, check it against the baseline (index 0, added first), warm up."""
        from autotuner.decompose import build, compiler_options

        problem, args = self.problem, self.args
        st: dict[str, Any] = {"ok": False, "reason": None, "compile_s": None, "memory": None, "rel_error": None}
        try:
            compiled, st["compile_s"], st["memory"] = self._compile(
                build(problem, strategy, self.mesh), args, compiler_options(strategy, self.platform))
            self.before_run(index)
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

    def before_run(self, index: int) -> None:
        """Called once a strategy compiled, before its first run: a multi-process runner checks
        there that every process compiled it (a program's collectives run only if all do)."""

    def add_parts(self) -> None:
        """Compile the collective alone and the einsum alone (for the bound)."""
        from autotuner.decompose import build_parts

        problem = self.problem
        if problem.pattern.kind == "none":
            return
        comm, comp = build_parts(problem, self.mesh)
        if isinstance(problem, GroupedProblem):
            from autotuner.decompose.grouped_allgather import compute_specs

            comp_args = self._group_arrays(problem, compute_specs(problem))
        else:
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
        from autotuner.decompose.baseline import gathered_specs

        return gathered_specs(problem)

    def time(self, program: int | str) -> float:
        fn, args = self.programs[program]
        self.sync.barrier()
        t0 = time.perf_counter()
        self._run(fn, args)
        return self.sync.max_over_processes(time.perf_counter() - t0)

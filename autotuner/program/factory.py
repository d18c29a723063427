"""A user's program for `plan`, `extract` and `bench-model`: loaded from MODULE:FACTORY, planned
by `overlap`, run plain and overlapped, in this process or in each process of a lab (`handle`,
the lab's handler: its own ops `step_load`/`step_time`, the tuner's per-problem ops for everything
else, so the per-pair breakdown runs on the same lab). The timing and the numerics check are
`autotuner.measure.steps`'. Not a command group (it registers nothing).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotuner.errors import AutotunerError
from autotuner.overlap.memory import DEFAULT_BOUND

HANDLER = "autotuner.program.factory:handle"


class ModelError(AutotunerError, ValueError):
    """The program could not be loaded, or its factory failed."""


@dataclass
class Program:
    fn: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    mesh: Any            # the jax Mesh built from the mesh shape given, or None


def _dotted(path: Path) -> str | None:
    """`tests/models/x.py` -> `tests.models.x` when the file lies under the current directory and
    every part is an identifier (then relative imports inside it work), else None."""
    try:
        rel = path.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        return None
    parts = [*rel.parts[:-1], rel.stem]
    return ".".join(parts) if all(p.isidentifier() for p in parts) else None


def import_target(target: str) -> Any:
    """The callable MODULE:ATTR (MODULE dotted, or a path to a .py file: one under the current
    directory is imported by its dotted name, so its relative imports work)."""
    mod_name, _, attr = target.rpartition(":")
    if not mod_name or not attr:   # no colon, or nothing on one side of it
        raise ModelError(f"{target!r}: expected MODULE:FUNCTION, e.g. autotuner.examples.transformer:example")
    if "" not in sys.path:
        sys.path.insert(0, "")
    try:
        if mod_name.endswith(".py") or "/" in mod_name:
            path = Path(mod_name)
            if not path.is_file():
                raise ModelError(f"{target!r}: no file {path}")
            dotted = _dotted(path)
            if dotted is not None:
                module = importlib.import_module(dotted)
            else:
                spec = importlib.util.spec_from_file_location(path.stem, path)
                assert spec is not None and spec.loader is not None
                module = importlib.util.module_from_spec(spec)
                sys.modules[path.stem] = module
                spec.loader.exec_module(module)
        else:
            module = importlib.import_module(mod_name)
    except ImportError as e:
        if "relative import" in str(e):
            raise ModelError(f"{target!r}: {mod_name} uses relative imports, which need its package: run "
                             "from the directory above the package, or name it as a dotted module "
                             "(pkg.mod:FUNCTION)") from None
        raise ModelError(f"{target!r}: cannot import {mod_name}: {e}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ModelError(f"{target!r}: {mod_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ModelError(f"{target!r}: {attr} is not callable")
    return obj


def make_mesh(shape: dict[str, int], explicit: bool) -> Any:
    import jax
    from jax.sharding import AxisType

    n = math.prod(shape.values())
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh(tuple(shape.values()), tuple(shape), axis_types=(kind,) * len(shape),
                         devices=jax.devices()[:n])


def load_factory(target: str, kwargs: dict[str, Any], mesh_shape: dict[str, int] | None,
                 explicit: bool) -> Program:
    """Import the factory and call it (see `call_factory`) on a mesh of `mesh_shape`."""
    factory = import_target(target)
    return call_factory(factory, target, kwargs, make_mesh(mesh_shape, explicit) if mesh_shape else None)


def call_factory(factory: Any, target: str, kwargs: dict[str, Any], mesh: Any) -> Program:
    """Call the factory with `kwargs`, plus mesh= when a mesh is given and it takes `mesh`."""
    kw = dict(kwargs)
    if mesh is not None:
        try:
            takes_mesh = "mesh" in inspect.signature(factory).parameters
        except (TypeError, ValueError):
            takes_mesh = False
        if takes_mesh:
            kw["mesh"] = mesh
    try:
        got = factory(**kw)
    except Exception as e:  # noqa: BLE001 - the user's factory failed
        raise ModelError(f"{target}: the factory raised {type(e).__name__}: {e}") from None
    if not isinstance(got, tuple) or len(got) not in (2, 3) or not callable(got[0]):
        raise ModelError(f"{target}: the factory must return (fn, args) or (fn, args, kwargs)")
    args = got[1]
    return Program(got[0], tuple(args) if isinstance(args, (list, tuple)) else (args,),
                   dict(got[2]) if len(got) == 3 else {}, mesh)


def plan_rows(plan: Any) -> list[dict[str, Any]]:
    """A plan as JSON-able rows (the problem and strategy as dicts)."""
    return [{"name": r.name, "key": r.key, "form": r.form, "strategy": r.strategy.key,
             "strategy_dict": r.strategy.to_dict(), "problem": r.problem.to_dict() if r.problem else None,
             "applied": r.applied, "source": r.source, "speedup": r.speedup, "saving": r.saving,
             "count": r.count, "member": r.member, "served_by": r.served_by, "kept_bytes": r.kept_bytes,
             "where": r.where, "note": r.note, "xla": r.xla,
             "traffic_speedup": r.split[0] if r.split else None,
             "overlap_speedup": r.split[1] if r.split else None} for r in plan]


TOLERANCE_HELP = ("the largest relative error of the overlapped step's outputs against plain jit's "
                  "(default: the dtypes' step tolerance). A program whose outputs amplify rounding, e.g. "
                  "Adam's first update divides each gradient by its own magnitude, may need more; the "
                  "check is there to catch a wrong decomposition, whose error is of the outputs' size")


def check_numerics(rows: list[dict[str, Any]], error: float, tolerance: float | None, what: str = "the overlapped step") -> float:
    """The tolerance in force (`tolerance`, else the step tolerance of the plan's dtypes); fails
    the command, saying how to read it, when `error` is above it."""
    from autotuner.problem import problem_from_dict
    from autotuner.program.console import fail
    from autotuner.testing import step_tolerance

    tol = tolerance if tolerance is not None else step_tolerance(
        {problem_from_dict(r["problem"]).dtype for r in rows if r["problem"]} or {"float32"})
    if not error <= tol:
        fail(f"{what} differs from plain jit: relative error {error:.3g} > {tol:g} (a wrong decomposition "
             "differs by the outputs' own size; if this program amplifies rounding, --tolerance sets the bound)")
    return tol


def plan_notes(plan: Any) -> list[str]:
    """What concerns the whole program: the compiled step's temp memory, plain vs overlapped (and
    the bound the pass kept to), what preparing it took, then the plan's notes."""
    return [str(plan.memory), str(plan.cost), *plan.notes]


class Bench:
    """Plain and overlapped programs of one factory, ready to time (see `measure.steps`). With
    `attribute`, also per decomposed problem (`measure.steps.decomposed_units`) the step with only
    that problem decomposed and the step with the plan minus it, each as the plan decides it
    (a callable strategy that returns the plan's choice for the problems it keeps)."""

    def __init__(self, prog: Program, strategy: Any, client: Any, memory: float | None,
                 attribute: bool = False) -> None:
        import jax

        from autotuner.overlap import overlap

        self.prog = prog
        fn = prog.fn if hasattr(prog.fn, "lower") else jax.jit(prog.fn)
        self.plain = fn
        self.overlapped = overlap(prog.fn, strategy=strategy, client=client, memory=memory)
        self.plan = self.overlapped.plan(*prog.args, **prog.kwargs)
        self.variants: list[Any] = []   # alone_1, without_1, alone_2, ... (Overlapped)
        self.variant_notes: list[str] = []
        if attribute:
            self._build_variants(memory)

    def _build_variants(self, memory: float | None) -> None:
        from autotuner.measure.steps import decomposed_units

        chosen = {r.key: r.strategy for r in self.plan if r.applied}
        choices, labels = [], []
        for u in decomposed_units(self.plan):
            for kind, keep in (("alone", {u.key}), ("without", set(chosen) - {u.key})):
                choices.append({x: chosen[x] for x in keep})
                labels.append(f"{u.name} {kind}")
        self.set_variants(choices, memory, labels)

    def set_variants(self, choices: list[dict[str, Any]], memory: float | None,
                     labels: list[str] | None = None) -> list[set[str]]:
        """The programs to time beside plain and the plan: per choice (problem key -> Strategy;
        every other problem baseline) the step `overlap` makes of it. Returns each one's applied
        problem keys; one that differs from its choice's non-baseline keys is noted."""
        from autotuner.overlap import overlap

        a, k = self.prog.args, self.prog.kwargs
        self.variants, self.variant_notes, applied = [], [], []
        for i, choice in enumerate(choices):
            ov = overlap(self.prog.fn, strategy=_Pick(choice), memory=memory)
            got = {r.key for r in ov.plan(*a, **k) if r.applied}
            want = {key for key, st in choice.items() if st.rewrites}
            if got != want:
                label = labels[i] if labels else f"variant {i + 1}"
                self.variant_notes.append(f"{label}: the pass applied {len(got)} problem(s), not the "
                                          f"{len(want)} asked (see its plan)")
            self.variants.append(ov)
            applied.append(got)
        return applied

    def thunks(self) -> list[Any]:
        """plain, overlapped, then the attribution's variants (alone_1, without_1, ...)."""
        a, k = self.prog.args, self.prog.kwargs
        return [lambda: self.plain(*a, **k), lambda: self.overlapped(*a, **k),
                *[(lambda v=v: v(*a, **k)) for v in self.variants]]

    def profile(self, steps: int, trace: bool = True) -> dict[str, Any]:
        """Plain and overlapped, each compiled again with XLA's thunk timings on and run `steps`
        times under the profiler (`measure.profile`); their `StepProfile`s as dicts (None where
        not traced: `trace=False` only runs them, in lockstep with a process that traces). With
        the attribution's variants, also each problem's step with only it decomposed (`alone`,
        in the variants' order), so that each one's saving splits too."""
        from dataclasses import asdict

        import jax

        from autotuner.measure.profile import COMPILE_OPTIONS, profile_steps

        a, k = self.prog.args, self.prog.kwargs
        def one(prog: Any) -> dict[str, Any] | None:
            compiled = prog.lower(*a, **k).compile(COMPILE_OPTIONS)
            for _ in range(2):
                jax.block_until_ready(compiled(*a, **k))
            got = profile_steps(lambda c=compiled: c(*a, **k), steps, trace=trace)
            return asdict(got) if got is not None else None

        out: dict[str, Any] = {"plain": one(self.plain), "overlapped": one(self.overlapped)}
        if self.variants:
            out["alone"] = [one(v) for v in self.variants[0::2]]
        return out

    def error(self, variants_only: bool = False) -> float:
        """The worst relative error of the overlapped results (and the variants') against plain
        jit's; `variants_only`: of the variants alone (0.0 when there are none)."""
        from autotuner.measure.steps import rel_error

        plain, ov, *others = (t() for t in self.thunks())
        errs = [rel_error(plain, o) for o in (others if variants_only else [ov, *others])]
        return max(errs, default=0.0)


class _Pick:
    """A strategy callable: the plan's choice for the problems in `table`, baseline elsewhere."""

    def __init__(self, table: dict[str, Any]) -> None:
        self.table = table

    def __call__(self, problem: Any) -> Any:
        from autotuner.strategy import Strategy

        got = self.table.get(problem.key)
        return got if got is not None else Strategy.baseline()


# -- the lab's handler ---------------------------------------------------------------------------

def handle(request: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """`step_load` (every process builds the program, plans it and checks its numerics; process
    0 answers the plan), `step_time` (interleaved timing); other ops: the tuner's handler."""
    op = request.get("op")
    if op == "step_load":
        return _step_load(request, ctx)
    if op == "step_time":
        from autotuner.measure.lab_target import CtxSync
        from autotuner.measure.steps import time_steps

        bench: Bench = ctx.state["bench"]
        plain, ov, *variants = time_steps(bench.thunks(), reps=int(request["reps"]),
                                          warmup=int(request.get("warmup", 2)), sync=CtxSync(ctx))
        return {"plain": plain, "overlapped": ov, "variants": variants}
    if op == "step_profile":
        return ctx.state["bench"].profile(int(request["steps"]), trace=ctx.process_id == 0)
    if op == "step_variants":
        from autotuner.strategy import Strategy

        bench = ctx.state["bench"]
        choices = [{k: Strategy.from_dict(v) for k, v in c.items()} for c in request["choices"]]
        applied = bench.set_variants(choices, request.get("memory", DEFAULT_BOUND))
        err = bench.error(variants_only=True)
        errs = ctx.gather_json(err)
        return {"applied": [sorted(a) for a in applied], "notes": bench.variant_notes,
                "rel_error": max(errs) if errs else err}
    from autotuner.measure.lab_target import handle as tuner_handle

    return tuner_handle(request, ctx)


def _step_load(request: dict[str, Any], ctx: Any) -> dict[str, Any]:
    from autotuner.device import Device
    from autotuner.runtime.client import Client
    from autotuner.strategy import Strategy

    prog = load_factory(request["target"], request.get("kwargs") or {}, request.get("mesh"),
                        bool(request.get("explicit", True)))
    strategy = request.get("strategy", "auto")
    if isinstance(strategy, dict):
        strategy = Strategy.from_dict(strategy)
    client = None
    if request.get("snapshot") and request.get("device"):
        client = Client(offline=request["snapshot"], device=Device.from_dict(request["device"]))
    bench = Bench(prog, strategy, client, request.get("memory", DEFAULT_BOUND), bool(request.get("attribute")))
    ctx.state["bench"] = bench
    err = bench.error()
    errs = ctx.gather_json(err)
    return {"plan": plan_rows(bench.plan), "program": bench.plan.program,
            "notes": plan_notes(bench.plan) + bench.variant_notes,
            "rel_error": max(errs) if errs else err}

"""A user's program opened on a target, for `bench-model` and `tune-model`: loaded from
MODULE:FACTORY, planned by `overlap` with the winners of --db/--service/--snapshot for the
target's device, its numerics checked against plain jit - in this process (`inproc:N`, `local`)
or in every process of a lab (`lab:...`, through the handler `autotuner.program.factory:handle`). The
two commands differ only in what they then time; `Opened` gives both the same operations.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from autotuner.lab.spec import LabWorkerError
from autotuner.program.console import fail, say

LOAD_TIMEOUT_S = 1800.0   # a lab's answer to loading, timing or profiling a whole step


def target_args(on: str, mesh: str | None, kwargs: str | None, memory: str
                ) -> tuple[Any, dict[str, int] | None, dict[str, Any], float | None]:
    """The --target, --mesh, --kwargs and --memory options parsed (the command fails on bad ones)."""
    from autotuner.measure.targets import Target, TargetError
    from autotuner.program.load import memory_arg, parse_kwargs, parse_mesh

    bound = memory_arg(memory)
    try:
        tgt = Target.parse(on)
    except TargetError as e:
        fail(str(e))
    return tgt, parse_mesh(mesh), parse_kwargs(kwargs), bound


@dataclass
class Opened:
    """The program planned on its target: the plan's rows (`factory.plan_rows`), notes, program key
    and worst relative error against plain jit; `runner_for(problem)` times one problem alone on
    the same target. Exactly one of `lab` and `bench` is set."""

    device: Any
    winners: Any
    rows: list[dict[str, Any]]
    notes: list[str]
    program: str
    error: float
    runner_for: Callable[[Any], Any]
    lab: Any = None
    bench: Any = None

    @cached_property
    def plan(self) -> list[Any]:
        """The plan's rows as `measure.steps` reads them, whichever process planned it."""
        from types import SimpleNamespace

        from autotuner.problem import problem_from_dict
        from autotuner.strategy import Strategy

        return [SimpleNamespace(applied=r["applied"], name=r["name"], count=r["count"], member=r["member"],
                                served_by=r["served_by"],
                                problem=problem_from_dict(r["problem"]) if r["problem"] else None,
                                strategy=Strategy.from_dict(r["strategy_dict"])) for r in self.rows]

    def _lab(self, request: dict[str, Any], what: str) -> dict[str, Any]:
        try:
            got = self.lab.call(request, LOAD_TIMEOUT_S, fresh=False)   # the loaded step lives in the workers
        except LabWorkerError as e:
            fail(f"the lab failed: {e}")
        if "error" in got:
            fail(f"the lab could not {what}: {got['error']}")
        return dict(got)

    def time(self, reps: int, warmup: int) -> list[list[float]]:
        """Seconds per step, interleaved: plain, the plan, then each variant."""
        if self.lab is not None:
            t = self._lab({"op": "step_time", "reps": reps, "warmup": warmup}, "time the step")
            return [t["plain"], t["overlapped"], *t["variants"]]
        from autotuner.measure.steps import time_steps

        return time_steps(self.bench.thunks(), reps=reps, warmup=warmup)

    def set_variants(self, choices: list[dict[str, Any]], memory: float | None) -> tuple[list[set[str]], float]:
        """The programs timed beside plain and the plan (`factory.Bench.set_variants`): each one's
        applied problem keys, and their worst relative error against plain jit."""
        if self.lab is not None:
            got = self._lab({"op": "step_variants", "memory": memory,
                             "choices": [{k: s.to_dict() for k, s in c.items()} for c in choices]},
                            "build the variants")
            return [set(a) for a in got["applied"]], float(got["rel_error"])
        applied = self.bench.set_variants(choices, memory)
        return applied, self.bench.error(variants_only=True)

    def profile(self, steps: int) -> dict[str, Any]:
        if self.lab is not None:
            return self._lab({"op": "step_profile", "steps": steps}, "profile the step")
        return dict(self.bench.profile(steps))


@contextlib.contextmanager
def open_program(tgt: Any, target: str, fkw: dict[str, Any], shape: dict[str, int] | None, explicit: bool,
                 strategy: Any, sources: dict[str, Any], tmp: str, *, memory: float | None, attribute: bool = False,
                 verb: str = "benchmarking", check: Callable[[Any, Any], None] | None = None) -> Iterator[Opened]:
    """`target` opened on `tgt` with the winners of `sources` (`winners.make_client`'s arguments)
    for the target's device and the program's number of devices; `check(winners, device)` runs
    before the program is planned. The command fails, saying why, if the target, the program or
    the lab does."""
    from autotuner.measure.targets import TargetError
    from autotuner.program.winners import make_client

    def client(n: int, dev: Any) -> Any:
        winners = make_client(**sources, n=n, tmpdir=tmp, prefer=dev.key)
        if check is not None:
            check(winners, dev)
        say(f"{verb} {target} on {tgt.text} ({dev.label}); {winners.said(strategy)}")
        return winners

    if tgt.kind == "lab":
        from autotuner.lab import Lab, LabSpec
        from autotuner.measure.lab_target import LabRunner
        from autotuner.program.factory import HANDLER

        spec = LabSpec.parse(tgt.text)
        lab = Lab(spec, HANDLER, log=say)
        try:
            lab.start()
            runner = LabRunner(lab, compile_timeout=LOAD_TIMEOUT_S, log=say)
            dev = runner.device()
            winners = client(spec.n, dev)
            got = lab.call({"op": "step_load", "target": target, "kwargs": fkw, "mesh": shape, "explicit": explicit,
                            "strategy": strategy if isinstance(strategy, str) else strategy.to_dict(),
                            "memory": memory, "attribute": attribute, "snapshot": winners.snapshot,
                            "device": winners.device.to_dict() if winners.device is not None else None},
                           LOAD_TIMEOUT_S)
            if "error" in got:
                fail(f"the lab could not load {target}: {got['error']}")
            yield Opened(dev, winners, got["plan"], got["notes"], got.get("program", ""), float(got["rel_error"]),
                         lambda _p: runner, lab=lab)
        except LabWorkerError as e:
            fail(f"the lab failed: {e}")
        finally:
            lab.close()
        return
    from autotuner.measure.targets import TargetSession
    from autotuner.program.factory import Bench, ModelError, load_factory, plan_notes, plan_rows
    from autotuner.program.load import mesh_size

    try:
        session = TargetSession(tgt, log=say)
    except TargetError as e:
        fail(str(e))
    with session:
        try:
            prog = load_factory(target, fkw, shape, explicit)
        except ModelError as e:
            fail(str(e))
        winners = client(mesh_size(prog), session.device)
        if attribute:
            say("attribution: compiling the step with each decomposed problem alone and the plan without it")
        bench = Bench(prog, strategy, winners.client, memory, attribute)
        yield Opened(session.device, winners, plan_rows(bench.plan), plan_notes(bench.plan) + bench.variant_notes,
                     bench.plan.program, bench.error(), session.runner, bench=bench)

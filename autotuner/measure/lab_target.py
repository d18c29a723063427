"""The `lab` target: measurements on the emulated mesh (`autotuner.lab`), in lockstep.

The parent (`LabRunner`, in the root namespace where the database lives) decides what to measure
next and sends one small request at a time to process 0 of the lab; every process runs `handle`
on it with the same arguments, so all build and run the same program; process 0 replies with the
merged result. One request per compiled candidate and per timed repetition means that a dead or
hung worker is pinned on the candidate it was running: that candidate is failed with the reason,
the lab restarts and the session goes on with the others (recompiled on the fresh lab).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from autotuner.device import Device
from autotuner.lab import Lab, LabSpec, LabWorkerError
from autotuner.measure.local import LocalRunner
from autotuner.problem import Problem, problem_from_dict
from autotuner.strategy import Strategy

HANDLER = "autotuner.measure.lab_target:handle"

# -- worker side --------------------------------------------------------------------------------

class CtxSync:
    """The lab's processes in lockstep, for the timing loops (`LocalRunner`, `steps.time_steps`)."""

    def __init__(self, ctx: Any):
        self.ctx, self.count = ctx, 0

    def barrier(self) -> None:
        self.count += 1
        self.ctx.barrier(f"rep-{self.count}")

    def max_over_processes(self, value: float) -> float:
        vals = self.ctx.gather_json(value)
        return max(vals) if vals is not None else value


def _merge(ctx: Any, status: dict[str, Any]) -> dict[str, Any]:
    """Process 0's view: failed if any process failed (with that process's reason)."""
    all_st = ctx.gather_json(status)
    if all_st is None:
        return status
    for pid, st in enumerate(all_st):
        if not st.get("ok", False):
            st = dict(st)
            if pid:
                st["reason"] = f"process {pid}: {st.get('reason')}"
            return st
    return all_st[0]


def handle(request: dict[str, Any], ctx: Any) -> dict[str, Any]:
    op = request.get("op")
    if op == "device":
        import jax

        d = Device.current(topology=ctx.spec.label)
        return {"device": d.to_dict(), "devices": jax.device_count()}
    if op == "begin":
        problem = problem_from_dict(request["problem"])
        names = [a for a, _ in problem.mesh]
        shape = [s for _, s in problem.mesh]
        runner = LocalRunner(ctx.mesh(names, shape), CtxSync(ctx), warmup=int(request.get("warmup", 2)))
        runner.begin(problem)
        ctx.state["runner"] = runner
        return {"ok": True}
    runner: LocalRunner = ctx.state["runner"]
    if op == "add":
        st = runner.add(int(request["index"]), Strategy.from_dict(request["strategy"]))
        return _merge(ctx, st)
    if op == "parts":
        try:
            runner.add_parts()
            st = {"ok": True}
        except Exception as e:  # noqa: BLE001
            st = {"ok": False, "reason": f"{type(e).__name__}: {e}"}
        return _merge(ctx, st)
    if op == "time":
        prog = request["program"]
        return {"t": runner.time(prog if isinstance(prog, str) else int(prog))}
    raise ValueError(f"unknown lab request {op!r}")


# -- parent side --------------------------------------------------------------------------------

class LabRunner:
    """A `measure.Runner` that forwards to a running Lab, restarting it around failures."""

    estimates = False   # it times programs that run

    def __init__(self, lab: Lab, *, compile_timeout: float = 300.0, time_timeout: float = 120.0,
                 log: Callable[[str], None] | None = None):
        self.lab, self.compile_timeout, self.time_timeout = lab, compile_timeout, time_timeout
        self.log = log or (lambda _msg: None)
        self.problem: Problem | None = None
        self.strategies: list[Strategy] = []
        self.ok: list[int] = []
        self.parts = False

    def _call(self, request: dict[str, Any], timeout: float, *, fresh: bool = False) -> dict[str, Any]:
        """Process 0's reply. Unless the request begins afresh (`fresh`), a lab that lost a worker
        since the last call has lost the programs compiled in it: a LabWorkerError (`Lab.call`)."""
        reply = self.lab.call(request, timeout, fresh=fresh)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def device(self) -> Device:
        return Device.from_dict(self._call({"op": "device"}, 120.0, fresh=True)["device"])

    def _begin(self) -> None:
        assert self.problem is not None
        self._call({"op": "begin", "problem": self.problem.to_dict()}, self.compile_timeout, fresh=True)

    def _add(self, i: int) -> dict[str, Any]:
        return self._call({"op": "add", "index": i, "strategy": self.strategies[i].to_dict()},
                          self.compile_timeout)

    def prepare(self, problem: Problem, strategies: Sequence[Strategy], parts: bool = True
                ) -> list[dict[str, Any]]:
        self.problem, self.strategies, self.ok = problem, list(strategies), []
        statuses: list[dict[str, Any]] = []
        self._begin()
        for i in range(len(self.strategies)):
            try:
                st = self._add(i)
            except LabWorkerError as e:
                st = {"ok": False, "reason": f"lab worker failed while compiling: {e}"}
                self._restore()
            if st.get("ok"):
                self.ok.append(i)
            statuses.append(st)
        self.parts = self._parts() if parts else False
        return statuses

    def _parts(self) -> bool:
        if self.problem is None or self.problem.pattern.kind == "none":
            return False
        try:
            return bool(self._call({"op": "parts"}, self.compile_timeout).get("ok"))
        except LabWorkerError:
            self._restore(parts=False)
            return False

    def _restore(self, *, parts: bool | None = None) -> None:
        """After a failure the lab starts afresh: rebuild what had compiled (it is recompiled)."""
        self.log("lab: restarting after a failure and recompiling the remaining candidates")
        self._begin()
        for i in list(self.ok):
            if not self._add(i).get("ok"):
                self.ok.remove(i)
        if parts if parts is not None else self.parts:
            self.parts = self._parts()

    def time(self, program: int | str) -> float:
        if isinstance(program, str) and not self.parts:
            raise RuntimeError("the parts did not compile")
        try:
            return float(self._call({"op": "time", "program": program}, self.time_timeout)["t"])
        except LabWorkerError:
            if isinstance(program, int) and program in self.ok:
                self.ok.remove(program)
            self._restore(parts=self.parts and not isinstance(program, str))
            raise


def open_lab(spec: LabSpec, log: Callable[[str], None] | None = None) -> Lab:
    return Lab(spec, HANDLER, log=log)

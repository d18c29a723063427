"""In-job tuning: `overlap(fn, client=..., tune="missing")` measures, on the job's own devices, the
units (problems, or grouped problems) the client has no `tuned` answer for, stores the results
through the client and applies the measured winners under the never-slower rule.

Per unit of the program, in program order, while the budget (`tune_budget_s`) lasts: the
candidates, likeliest first (the client's `model`/`nearest` pick, then `space(problem)`'s order;
at most `MAX_CANDIDATES`, fewer when the seconds one strategy took so far say the rest of the
budget holds fewer), are measured against the baseline in one `run_session` (`LocalRunner` on
the mesh of the program's arguments, `REPS` interleaved repetitions); `Client.upload` stores
the session (the service, the snapshot file, or nowhere without a token) and the answer replaces
the client's decision table's and the client's, so every later lookup with it sees it. A unit met once
the budget is spent stays as its answer says ("budget spent" in its row's note); the unit that
is being measured when the budget runs out is finished.

In a multi-process job every process measures the same strategies in the same order in lockstep
(`JaxSync`: barriers and the max over processes of each time through the `jax.distributed`
key-value store): process 0 decides what to measure and publishes it, and later the answer, as
the decision tables do; only process 0 talks to the client. A strategy that fails to compile or
check on any process is failed on every process (`_JobRunner`), so no process times a program
another does not run. Every wait is bounded by the budget (`tune_budget_s`): a process that fails
(an exception while measuring, or process 0 while storing the answer) says so through the store,
or is waited for no longer than that, and then every process ends in-job tuning for the rest of
the preparation (`InJob.ended`); the program is planned with the answers it had.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, replace
from typing import Any

from autotuner.measure.local import LocalRunner
from autotuner.overlap import agree
from autotuner.problem import GroupedProblem, Problem
from autotuner.strategy import Strategy, reference

log = logging.getLogger("autotuner.overlap")

MODES = (None, "missing")
DEFAULT_BUDGET_S = 60.0
REPS = 5              # interleaved repetitions per session
MAX_CANDIDATES = 6    # strategies measured per unit besides the baseline
_KV_PREFIX = "autotuner/overlap/in-job/v1/"
_calls = itertools.count()


class JaxSync:
    """A `measure.Sync` over the processes of a `jax.distributed` job, through its key-value store
    (`overlap.agree`'s publish and receive; not a device collective, which waits forever for a
    process that does not come): each exchange waits at most `timeout_s` for the others, then
    raises."""

    def __init__(self, tag: str, timeout_s: float) -> None:
        self.tag, self.count, self.timeout_s = tag, 0, timeout_s

    def exchange(self, value: Any, name: str = "") -> list[Any]:
        """Every process's `value` (JSON), in process order, once all have given theirs; `name`
        the exchange's (each process's n-th unnamed one is the n-th of the others)."""
        me, count = agree.processes()
        if not name:
            self.count += 1
        key = f"{self.tag}/{name or self.count}"
        agree.publish(f"{key}/{me}", value)
        out = []
        for r in range(count):
            try:
                out.append(value if r == me else agree.receive(f"{key}/{r}", f"word from process {r}", self.timeout_s))
            except agree.AgreeError as e:
                raise SyncTimeout(f"{WAITED} {r} in vain: {e}") from None
        return out

    def barrier(self) -> None:
        self.exchange(None)

    def max_over_processes(self, value: float) -> float:
        return float(max(self.exchange(value)))


WAITED = "waited for process"


class SyncTimeout(Exception):   # noqa: N818 - what JaxSync raises when another process does not come
    pass


class _JobRunner(LocalRunner):
    """`LocalRunner` whose steps are agreed over the job's processes before any program runs (its
    collectives would wait for a process that is not there, and a collective given up on leaves
    the job's communicators broken): every process began the problem, compiled the strategy; and
    its statuses merged: failed on one, failed on all (with that process's reason)."""

    sync: JaxSync

    def begin(self, problem: Problem) -> None:
        super().begin(problem)
        self.ran: set[int] = set()
        self.sync.exchange(True, "begun")   # a process that could not begin never comes: the others stop here

    def before_run(self, index: int) -> None:
        self.ran.add(index)
        for pid, ok in enumerate(self.sync.exchange(True, f"compiled/{index}")):
            if not ok:
                raise RuntimeError(f"process {pid} could not compile it")

    def add(self, index: int, strategy: Strategy) -> dict[str, Any]:
        st = super().add(index, strategy)
        if index not in self.ran:   # its compile raised here: the others must not run it either
            self.sync.exchange(False, f"compiled/{index}")
        for pid, other in enumerate(self.sync.exchange({"ok": st["ok"], "reason": st["reason"]}, f"status/{index}")):
            if not other["ok"]:
                return {**st, "ok": False, "reason": other["reason"] if st["reason"] == other["reason"]
                        else f"process {pid}: {other['reason']}"}
        return st


class _Failed(Exception):
    """In-job tuning of a unit failed (on this process or another); the message says where."""


@dataclass
class Record:
    """What in-job tuning did with one unit."""

    measured: bool = False
    seconds: float = 0.0
    tried: int = 0          # strategies measured besides the baseline
    stored: str = ""        # where the results went
    skipped: str = ""       # why it was not measured (or failed)
    winner: str = ""        # the measured winner's key and speedup interval

    def note(self) -> str:
        if self.measured:
            return (f"measured in this job: {self.tried} strateg{'y' if self.tried == 1 else 'ies'} and the "
                    f"baseline in {self.seconds:.1f} s ({self.winner}); stored in {self.stored}")
        return f"not tuned in this job: {self.skipped}"


def likeliest(unit: Problem | GroupedProblem, answer_strategy: Strategy | None, device: Any) -> list[Strategy]:
    """The decompositions to measure for `unit`, likeliest first: the client's pick (a `model` or
    `nearest` answer's strategy), then the order of `space(unit, device)`. Only rings: XLA's
    windowed einsum is a whole-program option, not a per-pair rewrite."""
    from autotuner.decompose.space import space

    cands = [s for s in space(unit, device) if s.method == "ring"]
    if answer_strategy is not None and answer_strategy in cands:
        cands.remove(answer_strategy)
        cands.insert(0, answer_strategy)
    return cands


class InJob:
    """In-job tuning for one preparation of one signature (see the module docs)."""

    def __init__(self, client: Any, mesh: Any, budget_s: float) -> None:
        from autotuner.runtime.client import default_client

        self.lookup_client = client          # what `decisions_for(...).decide` is asked with (as `choose` does)
        self.client = client if client is not None else default_client()
        self.mesh, self.budget_s = mesh, float(budget_s)
        self.spent = 0.0
        self.records: dict[str, Record] = {}
        self.call = next(_calls)
        self._per_strategy: float | None = None
        self.ended = ""   # why in-job tuning ended on every process of the job ("": it goes on)

    # -- per round of the analysis ---------------------------------------------------------------
    def run(self, sites: list[Any], evidence: dict[str, Any]) -> None:
        """Measure every unit of `sites` whose answer is not `tuned` (and that has no in-program
        evidence), while the budget lasts."""
        from autotuner.runtime.collective import decisions_for

        units: dict[str, Problem | GroupedProblem] = {}
        for site in sites:
            if site is not None:
                units.setdefault(site.unit.key, site.unit)
        for key, unit in units.items():
            if key in self.records or key in evidence:
                continue
            d = decisions_for(self.lookup_client).decide(unit, self.lookup_client)
            if d.source == "tuned":
                continue
            self.records[key] = Record(skipped=f"in-job tuning ended ({self.ended})") if self.ended else self._tune(unit, d)

    def mark(self, sites: list[Any], rows: list[Any]) -> list[Any]:
        """The rows, those of measured units with source "in-job", every unit this tuning touched
        with its note."""
        out = []
        for site, row in zip(sites, rows, strict=True):
            rec = self.records.get(site.unit.key) if site is not None else None
            if rec is None or row.served_by:
                out.append(row)
            elif rec.measured:
                out.append(replace(row, source="in-job", note="; ".join(t for t in (rec.note(), row.note) if t)))
            else:
                out.append(replace(row, note="; ".join(t for t in (row.note, rec.note()) if t)))
        return out

    def summary(self) -> str:
        measured = [r for r in self.records.values() if r.measured]
        spent = sum(1 for r in self.records.values() if not r.measured and r.skipped.startswith("the in-job"))
        where = sorted({r.stored for r in measured})
        return (f"in-job tuning (tune='missing'): {len(measured)} problem(s) measured in {self.spent:.1f} s "
                f"of the {self.budget_s:g} s budget"
                + (f", {spent} left untuned (budget spent)" if spent else "")
                + (f"; stored in {', '.join(where)}" if where else ""))

    # -- one unit --------------------------------------------------------------------------------
    def _plan(self, unit: Problem | GroupedProblem, d: Any) -> list[Strategy] | str:
        """Process 0's choice of what to measure for `unit`, or why nothing."""
        remaining = self.budget_s - self.spent
        if remaining <= 0:
            return f"the in-job tuning budget ({self.budget_s:g} s) was spent"
        device = getattr(self.client, "device", None)
        pick = d.strategy if d.source in ("model", "nearest") and d.strategy.rewrites else None
        cands = likeliest(unit, pick, device)
        if not cands:
            return "no decomposition applies to this problem"
        n = MAX_CANDIDATES
        if self._per_strategy:
            n = min(n, max(1, int(remaining / self._per_strategy) - 1))
        return cands[:n]

    def _store(self, unit: Problem | GroupedProblem, session: Any) -> tuple[Any, str]:
        """(the session's answer, where it was stored), on process 0: through the client, or kept
        in this process without one."""
        from autotuner.runtime.client import session_answer

        if self.client is not None and hasattr(self.client, "upload"):
            return self.client.upload(None, unit, session, name="in-job tuning")  # type: ignore[no-any-return]
        dev_key = getattr(getattr(self.client, "device", None), "key", None)
        if dev_key is None:
            from autotuner.device import Device

            dev_key = Device.current().key
        return session_answer(session, unit.key, dev_key), "nowhere (no client): it holds for this process only"

    def _answer(self, unit: Problem | GroupedProblem, session: Any, multi: bool, first: bool) -> tuple[Any, str]:
        """(the session's answer, where it was stored): process 0's, published to the others.
        Raises `_Failed` on every process where process 0 could not make or store it."""
        from autotuner.answer import Answer

        answer, stored, shared = None, "", None
        if first:
            try:
                answer, stored = self._store(unit, session)
                shared = {"answer": answer.to_json() if answer is not None else None, "stored": stored}
            except Exception as e:  # noqa: BLE001 - said to every process, which all end tuning
                shared = {"error": f"process 0 could not store the answer ({type(e).__name__}: {e})"}
        if multi:
            shared = self._share(f"answer/{self.call}/{unit.key}", shared)
        if "error" in shared:
            raise _Failed(str(shared["error"]))
        if not first:
            a = shared["answer"]
            answer, stored = (Answer.from_json(a, "process0") if a is not None else None), str(shared["stored"])
        return answer, stored

    def _tune(self, unit: Problem | GroupedProblem, d: Any) -> Record:
        """One unit measured (in lockstep over the job's processes); in a multi-process job a
        failure anywhere ends in-job tuning on every process (`ended`)."""
        import jax

        multi = jax.process_count() > 1
        t0 = time.perf_counter()
        try:
            return self._measure(unit, d, multi, jax.process_index() == 0, t0)
        except _Failed as e:
            self.spent += time.perf_counter() - t0
            log.warning("overlap: in-job tuning of %s: %s%s", unit.describe(), e,
                        "; in-job tuning ends on every process" if multi else "")
            if multi:
                self.ended = str(e)
            return Record(seconds=time.perf_counter() - t0, skipped=str(e))

    def _measure(self, unit: Problem | GroupedProblem, d: Any, multi: bool, first: bool, t0: float) -> Record:
        from autotuner.measure.session import run_session
        from autotuner.runtime.collective import decisions_for

        plan: list[Strategy] | str | None = None
        if first:
            try:
                plan = self._plan(unit, d)
            except Exception as e:  # noqa: BLE001 - never worse than the answer it had
                plan = f"could not choose what to measure ({type(e).__name__}: {e})"
        if multi:
            plan = self._share(f"plan/{self.call}/{unit.key}", plan)
        if isinstance(plan, str):
            return Record(skipped=plan)
        assert plan is not None
        why = ""
        try:
            tag = f"{_KV_PREFIX}{self.call}/{unit.key}"
            runner = _JobRunner(self.mesh, JaxSync(tag, self.budget_s)) if multi else LocalRunner(self.mesh)
            ref = reference(str(self.mesh.devices.flat[0].platform))
            session = run_session(runner, unit, [ref, *plan], reps=REPS, parts=False, reference=ref)
        except Exception as e:  # noqa: BLE001 - never worse than the answer it had
            why = f"the measurement failed ({type(e).__name__}: {e})"
        if multi:   # every process's outcome, on a key of its own: wherever each one stopped
            outcomes = self._outcomes(f"{_KV_PREFIX}{self.call}/{unit.key}/outcome", why)
            # the cause, not a process that only waited for the one that failed
            failed = [(pid, w) for pid, w in enumerate(outcomes) if w]
            bad = next((f for f in failed if WAITED not in f[1]), failed[0] if failed else None)
            if bad is not None:
                raise _Failed(bad[1] if bad[1] == why else f"on process {bad[0]}: {bad[1]}")
        elif why:
            raise _Failed(why)
        answer, stored = self._answer(unit, session, multi, first)
        seconds = time.perf_counter() - t0
        self.spent += seconds
        self._per_strategy = session.seconds / (1 + len(plan))
        if answer is not None:
            decisions_for(self.lookup_client).put(replace(answer, problem_key=unit.key, source="tuned", origin="in-job"))
            ci = f" [{answer.confidence[0]:.3f}, {answer.confidence[1]:.3f}]" if answer.confidence else ""
            won = f"winner {answer.strategy.key} x{answer.speedup or 1.0:.3f}{ci}"
        else:
            won = "no winner: the baseline did not run"
        return Record(measured=True, seconds=seconds, tried=len(plan), stored=stored, winner=won)

    def _outcomes(self, tag: str, why: str) -> list[str]:
        """Every process's outcome of one unit ("" or why it failed), each waited for at most the
        budget (a process that never says failed)."""
        try:
            return [str(w) for w in JaxSync(tag, self.budget_s).exchange(why)]
        except SyncTimeout as e:   # the others did not say in time
            raise _Failed(why or f"another process did not finish measuring within the {self.budget_s:g} s "
                          f"budget ({e})") from None

    def _share(self, name: str, value: Any) -> Any:
        """Process 0's `value` on every process (through the distributed key-value store), waited
        for at most the budget."""
        import jax

        from autotuner.runtime.collective import DecisionError, _kv_client

        kv = _kv_client()
        if kv is None:
            raise DecisionError("overlap(tune='missing'): several processes but no jax.distributed key-value "
                                "store to agree on what to measure")
        key = _KV_PREFIX + name
        if jax.process_index() == 0:
            if isinstance(value, list):
                payload = {"strategies": [s.to_dict() for s in value]}
            elif isinstance(value, str):
                payload = {"skip": value}
            else:
                payload = {"value": value}
            agree.publish(key, payload)
            return value
        try:
            payload = agree.receive(key, f"{name.split('/')[0]} from process 0", self.budget_s)
        except agree.AgreeError as e:
            raise _Failed(f"process 0 did not publish in time: {e}") from None
        if "strategies" in payload:
            return [Strategy.from_dict(s) for s in payload["strategies"]]
        if "skip" in payload:
            return str(payload["skip"])
        return payload["value"]

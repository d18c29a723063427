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
(`JaxSync`: barriers through `sync_global_devices`, the max over processes of each time through
`process_allgather`): process 0 decides what to measure and publishes it, and later the answer,
in the `jax.distributed` key-value store, as the decision tables do; only process 0 talks to the client.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from dataclasses import dataclass, replace
from typing import Any

from autotuner.problem import GroupedProblem, Problem
from autotuner.strategy import Strategy, reference

log = logging.getLogger("autotuner.overlap")

MODES = (None, "missing")
DEFAULT_BUDGET_S = 60.0
REPS = 5              # interleaved repetitions per session
MAX_CANDIDATES = 6    # strategies measured per unit besides the baseline
SHARE_TIMEOUT_S = 3600.0   # how long processes > 0 wait for process 0's plan of a unit
_KV_PREFIX = "autotuner/overlap/in-job/v1/"
_calls = itertools.count()


class JaxSync:
    """A `measure.Sync` over the processes of a `jax.distributed` job."""

    def __init__(self, tag: str) -> None:
        self.tag, self.count = tag, 0

    def barrier(self) -> None:
        from jax.experimental import multihost_utils

        self.count += 1
        multihost_utils.sync_global_devices(f"{self.tag}/{self.count}")

    def max_over_processes(self, value: float) -> float:
        import numpy as np
        from jax.experimental import multihost_utils

        return float(np.max(multihost_utils.process_allgather(np.asarray(value, dtype=np.float64))))


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
            self.records[key] = self._tune(unit, d)

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

    def _answer(self, unit: Problem | GroupedProblem, session: Any, multi: bool, first: bool) -> tuple[Any, str]:
        """(the session's answer, where it was stored): process 0 stores it through the client (or
        keeps it in this process without one) and publishes both; the others read them."""
        from autotuner.runtime.client import session_answer

        answer, stored = None, ""
        shared: Any = None
        if first:
            if self.client is not None and hasattr(self.client, "upload"):
                answer, stored = self.client.upload(None, unit, session, name="in-job tuning")
            else:
                dev_key = getattr(getattr(self.client, "device", None), "key", None)
                if dev_key is None:
                    from autotuner.device import Device

                    dev_key = Device.current().key
                answer = session_answer(session, unit.key, dev_key)
                stored = "nowhere (no client): it holds for this process only"
            shared = {"answer": answer.to_json() if answer is not None else None, "stored": stored}
        if multi:
            shared = self._share(f"answer/{self.call}/{unit.key}", shared)
            if not first:
                from autotuner.answer import Answer

                a = shared["answer"]
                answer = Answer.from_json(a, "process0") if a is not None else None
                stored = shared["stored"]
        return answer, stored

    def _tune(self, unit: Problem | GroupedProblem, d: Any) -> Record:
        import jax

        from autotuner.measure.local import LocalRunner
        from autotuner.measure.session import run_session
        from autotuner.runtime.collective import decisions_for

        multi = jax.process_count() > 1
        first = jax.process_index() == 0
        t0 = time.perf_counter()
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
        try:
            runner = LocalRunner(self.mesh, JaxSync(f"{_KV_PREFIX}{self.call}/{unit.key}") if multi else None)
            ref = reference(str(self.mesh.devices.flat[0].platform))
            session = run_session(runner, unit, [ref, *plan], reps=REPS, parts=False, reference=ref)
        except Exception as e:  # noqa: BLE001 - never worse than the answer it had
            self.spent += time.perf_counter() - t0
            log.warning("overlap: in-job measurement of %s failed (%s: %s)", unit.describe(), type(e).__name__, e)
            return Record(seconds=time.perf_counter() - t0, skipped=f"the measurement failed ({type(e).__name__}: {e})")
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

    @staticmethod
    def _share(name: str, value: Any) -> Any:
        """Process 0's `value` on every process (through the distributed key-value store)."""
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
            kv.key_value_set(key, json.dumps(payload), allow_overwrite=True)
            return value
        payload = json.loads(kv.blocking_key_value_get(key, int(SHARE_TIMEOUT_S * 1000)))
        if "strategies" in payload:
            return [Strategy.from_dict(s) for s in payload["strategies"]]
        if "skip" in payload:
            return str(payload["skip"])
        return payload["value"]

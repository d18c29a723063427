"""`bench-model --target lab:...`: the program is built in every process of the lab (the handler
`autotuner.cli.model:handle`), which plans it, checks its numerics and times it; the parent
times each decomposed pair alone on the same lab through the tuner's `LabRunner`."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from autotuner.cli.common import err, fail
from autotuner.cli.winners import make_client

LOAD_TIMEOUT_S = 1800.0


def bench_on_lab(tgt: Any, target: str, fkw: dict[str, Any], shape: dict[str, int] | None, explicit: bool,
                 chosen: Any, sources: dict[str, Any], tmp: str, *, reps: int, warmup: int, pairs: bool,
                 pair_reps: int, memory: float | None,
                 attribute: bool = False, profile: int = 0, tolerance: float | None = None
                 ) -> tuple[Any, list[dict[str, Any]], list[str], float, Any]:
    from autotuner.cli.model import HANDLER, check_numerics
    from autotuner.lab import Lab, LabSpec, LabWorkerError
    from autotuner.measure.lab import LabRunner
    from autotuner.measure.steps import attribute as attribution
    from autotuner.measure.steps import compare, decomposed_units, pair_breakdown
    from autotuner.problem import problem_from_dict
    from autotuner.strategy import Strategy

    def say(m: str) -> None:
        err.print(m, highlight=False)

    spec = LabSpec.parse(tgt.text)
    lab = Lab(spec, HANDLER, log=say)
    try:
        lab.start()
        runner = LabRunner(lab, compile_timeout=LOAD_TIMEOUT_S, log=say)
        dev = runner.device()
        winners = make_client(**sources, n=spec.n, tmpdir=tmp, prefer=dev.key)
        say(f"benchmarking {target} on {tgt.text} ({dev.label}); {winners.where}")
        got = lab.call({"op": "step_load", "target": target, "kwargs": fkw, "mesh": shape, "explicit": explicit,
                        "strategy": chosen if isinstance(chosen, str) else chosen.to_dict(),
                        "memory": memory, "attribute": attribute, "snapshot": winners.snapshot,
                        "device": winners.device.to_dict() if winners.device is not None else None},
                       LOAD_TIMEOUT_S)
        if "error" in got:
            fail(f"the lab could not load {target}: {got['error']}")
        rows, notes, error = got["plan"], got["notes"], float(got["rel_error"])
        check_numerics(rows, error, tolerance)
        say(f"numerics: overlapped = plain jit within {error:.2g} (relative); timing {reps} steps each")
        t = lab.call({"op": "step_time", "reps": reps, "warmup": warmup}, LOAD_TIMEOUT_S)
        if "error" in t:
            fail(f"the lab could not time {target}: {t['error']}")
        res = compare(t["plain"], t["overlapped"], reps)
        plan = [SimpleNamespace(applied=r["applied"], name=r["name"], count=r["count"], member=r["member"],
                                served_by=r["served_by"],
                                problem=problem_from_dict(r["problem"]) if r["problem"] else None,
                                strategy=Strategy.from_dict(r["strategy_dict"])) for r in rows]
        if pairs:
            res.pairs = pair_breakdown(plan, lambda _p: runner, reps=pair_reps, log=say)
        if profile:
            got = lab.call({"op": "step_profile", "steps": profile}, LOAD_TIMEOUT_S)
            if "error" in got:
                fail(f"the lab could not profile {target}: {got['error']}")
            res.profile = got
        if attribute:
            v = t["variants"]
            res.attribution = attribution(decomposed_units(plan), t["plain"], t["overlapped"], v[0::2], v[1::2],
                                          res.pairs)
    except LabWorkerError as e:
        fail(f"the lab failed: {e}")
    finally:
        lab.close()
    return res, rows, notes, error, dev

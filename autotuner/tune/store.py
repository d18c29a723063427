"""From autotuner's types to the database's plain values (db imports nothing of ours); a
device's are `autotuner.snapshot.device_values`, shared with the cost model's store."""

from __future__ import annotations

import socket
from typing import Any

from autotuner.device import Device
from autotuner.problem import Problem
from autotuner.results import measurement_item, results_body, session_items
from autotuner.snapshot import device_values

__all__ = ["measurement_item", "problem_values", "record", "results_body", "save", "save_failure", "session_items",
           "why_no_winner", "why_unresolved"]


def problem_values(p: Problem, name: str | None = None) -> dict[str, Any]:
    f = p.features()
    return {"key": p.key, "canonical": p.canonical(), "equation": p.equation, "pattern": p.pattern.label,
            "dtype": p.dtype, "mesh_size": p.axis_size, "m": f["m"], "n": f["n"], "k": f["k"], "b": f["b"],
            "flops": f["flops"], "comm_bytes": f["comm_bytes"], "name": (name or None) and name[:256]}


def save(database: Any, device: Device, problem: Problem, items: list[dict[str, Any]],
         name: str | None = None, token_id: int | None = None) -> Any:
    """Record measurements (uploaded with the stored token `token_id`, if any) and recompute the
    winner in one transaction; returns the WinnerRecord. A problem that has a winner now is no
    longer a failed one (its failure record goes)."""
    return record(database, device, problem, items, name, token_id)[0]


def record(database: Any, device: Device, problem: Problem, items: list[dict[str, Any]],
           name: str | None = None, token_id: int | None = None) -> tuple[Any, int]:
    """:func:`save`, and how many of the items were stored (a replay of a run's measurement is
    not stored twice: `db.repository.record_measurements`)."""
    from db import repository as repo

    with database.session() as s:
        dev = repo.upsert_device(s, **device_values(device))
        prob = repo.upsert_problem(s, **problem_values(problem, name))
        stored = repo.record_measurements(s, dev.id, prob.id, items, token_id=token_id)
        winner = repo.recompute_winner(s, dev.id, prob.id)
        if winner is not None:
            repo.clear_failure(s, dev.id, prob.id)
        return winner, len(stored)


def save_failure(database: Any, device: Device, problem: Problem, *, error: str, name: str | None = None,
                 run_id: str | None = None) -> Any:
    """Record that `problem` could not be tuned on `device` and why; returns the FailureRecord."""
    from db import repository as repo

    with database.session() as s:
        dev = repo.upsert_device(s, **device_values(device))
        prob = repo.upsert_problem(s, **problem_values(problem, name))
        return repo.record_failure(s, dev.id, prob.id, error=error, name=(name or None) and name[:256],
                                   run_id=run_id, host=socket.gethostname()[:256])


def why_unresolved(database: Any, device: Device, problem: Problem) -> str | None:
    """Why the stored measurements of `problem` on `device` do not decide its winner
    (`db.apply_rule.why_unresolved`: the reference stays meanwhile), None where they do."""
    from autotuner.rule import reference_method
    from db.apply_rule import why_unresolved as why

    ms = _measurements(database, device, problem)
    return why(ms, reference_method(device.platform)) if ms else None


def _measurements(database: Any, device: Device, problem: Problem) -> list[Any]:
    """Every stored measurement of `problem` on `device` ([] where either is not stored)."""
    from db import repository as repo

    with database.session(read_only=True) as s:
        dev, prob = repo.get_device_by_key(s, device.key), repo.get_problem_by_key(s, problem.key)
        return repo.list_measurements(s, prob.id, dev.id) if dev and prob else []


def why_no_winner(database: Any, device: Device, problem: Problem) -> str:
    """Why `problem` has no winner on `device`: the latest baseline failure's reason (nothing can
    beat a baseline that does not run), else the latest failure's."""
    failed = [m for m in _measurements(database, device, problem) if m.status != "ok"]
    base = [m for m in failed if m.strategy_key == "baseline"]
    if base:
        return f"the baseline failed: {base[-1].reason or 'no reason given'}"
    if failed:
        return f"every candidate failed; the last: {failed[-1].reason or 'no reason given'}"
    return "no measurement succeeded"

"""From autotuner's types to the database's plain values (db imports nothing of ours)."""

from __future__ import annotations

import socket
from collections.abc import Iterable
from typing import Any

from autotuner.device import Device
from autotuner.measure import Candidate, SessionResult
from autotuner.problem import Problem


def device_values(d: Device) -> dict[str, Any]:
    return {"key": d.key, **d.to_dict()}


def problem_values(p: Problem) -> dict[str, Any]:
    f = p.features()
    return {"key": p.key, "canonical": p.canonical(), "equation": p.equation, "pattern": p.pattern.label,
            "dtype": p.dtype, "mesh_size": p.axis_size, "m": f["m"], "n": f["n"], "k": f["k"], "b": f["b"],
            "flops": f["flops"], "comm_bytes": f["comm_bytes"]}


def measurement_item(c: Candidate, run_id: str | None = None, host: str | None = None) -> dict[str, Any]:
    """A candidate as a ``db.MeasurementInput`` (``db.records.measurement_input``: the fields
    of the same names), with its strategy key and this run's id and host."""
    from db.records import measurement_input

    return measurement_input(c, strategy_key=c.key, run_id=run_id,
                             host=host or socket.gethostname())


def session_items(session: SessionResult, run_id: str | None = None,
                  include: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """Measurement items of a session: the baseline and every candidate (or those in `include`)."""
    keep = set(include) if include is not None else None
    return [measurement_item(c, run_id) for c in [session.baseline, *session.candidates]
            if keep is None or c.key in keep]


def save(database: Any, device: Device, problem: Problem, items: list[dict[str, Any]]) -> Any:
    """Record measurements and recompute the winner in one transaction; returns the WinnerRecord."""
    from db import repository as repo

    with database.session() as s:
        dev = repo.upsert_device(s, **device_values(device))
        prob = repo.upsert_problem(s, **problem_values(problem))
        repo.record_measurements(s, dev.id, prob.id, items)
        return repo.recompute_winner(s, dev.id, prob.id)

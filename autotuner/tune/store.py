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
    return {"strategy": c.strategy, "strategy_key": c.key, "status": c.status, "reason": c.reason,
            "samples": list(c.samples), "median_s": c.median_s, "iqr_s": c.iqr_s, "min_s": c.min_s,
            "n": c.n, "ratio": c.ratio, "ratio_lo": c.ratio_lo, "ratio_hi": c.ratio_hi,
            "compile_s": c.compile_s, "memory": c.memory, "run_id": run_id,
            "host": host or socket.gethostname()}


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

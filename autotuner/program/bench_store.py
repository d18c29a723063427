"""`bench-model --db URL`: the run's result (the `StepBench` bench-model prints) stored as one row
of the results database's `model_benches` (the dashboard's models page shows them). Not a command
group (it registers nothing)."""

from __future__ import annotations

import math
import socket
from typing import Any

from autotuner.program.console import db_url, fail, open_database


def _finite(x: Any) -> Any:
    """JSON-safe: a non-finite float becomes None, in nested lists and objects too."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def bench_values(res: Any, *, program: str, kwargs: dict[str, Any], target: str, mesh: dict[str, int] | None,
                 strategy: str, rel_error: float | None) -> dict[str, Any]:
    """The `db.repository.record_model_bench` keywords of a bench-model result."""
    d = _finite(res.to_dict())
    p, o = d["plain"], d["overlapped"]
    return {"program": program[:512], "kwargs": _finite(kwargs), "target": target[:256], "mesh": mesh,
            "strategy": strategy[:256], "reps": res.reps,
            "plain_s": p["median_s"], "plain_lo_s": p["lo_s"], "plain_hi_s": p["hi_s"],
            "overlapped_s": o["median_s"], "overlapped_lo_s": o["lo_s"], "overlapped_hi_s": o["hi_s"],
            "speedup": d["speedup"], "speedup_lo": d["speedup_lo"], "speedup_hi": d["speedup_hi"],
            "slower": bool(res.slower), "rel_error": _finite(rel_error), "pairs": d["pairs"],
            "comm_s": d["comm_s"], "decomposed_comm_s": d["decomposed_comm_s"],
            "predicted_saved_s": d["predicted_saved_s"], "host": socket.gethostname()[:256],
            "attribution": d.get("attribution")}


def store_bench(url: str, device: Any, values: dict[str, Any]) -> int:
    """Store one run (`values` from `bench_values`) for `device` (an `autotuner.Device`) in the
    results database at `url`; returns its id."""
    from autotuner.snapshot import device_values
    from db import SchemaError, StorageError
    from db import repository as repo

    try:
        database = open_database(db_url(url))
        with database.session() as s:
            dev = repo.upsert_device(s, **device_values(device))
            rec = repo.record_model_bench(s, dev.id, **values)
    except (SchemaError, StorageError, ValueError) as e:
        fail(f"--db {url}: cannot store the result: {str(e).splitlines()[0]}")
    database.engine.dispose()
    return int(rec.id)

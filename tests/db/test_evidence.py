"""In-program evidence in the database (issue 24 item 3): record, the newest row of each
(program, problem) in use, listing for snapshots, checks on write; SQLite and PostgreSQL. And a
bench-model run keeps its attribution."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from db import Database, NotFoundError
from db import repository as repo

from .test_benches import bench_values
from .test_repository import add_device

T0 = datetime(2026, 12, 4, 6, 0, tzinfo=UTC)
RING = {"method": "ring", "direction": "uni", "chunks": 2, "unroll": "full", "fuse": "loop", "send_first": True}
BASE = {"method": "baseline"}


def ev(problem: str = "p" * 64, program: str = "a" * 16, **overrides: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "program_key": program, "program": "m:train_step {}", "problem_key": problem, "name": "bsd,df->bsf",
        "strategy": RING, "strategy_key": "ring-uni-c2-ufull-loop-send", "previous": BASE,
        "previous_key": "baseline", "speedup": 1.08, "speedup_lo": 1.03, "speedup_hi": 1.12, "reps": 15,
        "tried": [{"strategy_key": "ring-uni-c2-ufull-loop-send", "speedup": 1.08, "speedup_lo": 1.03,
                   "speedup_hi": 1.12}]}
    values.update(overrides)
    return values


def test_newest_evidence_per_program_and_problem_is_in_use(database: Database) -> None:
    with database.session() as s:
        dev, other = add_device(s), add_device(s, key="dev-b")
        repo.record_evidence(s, dev.id, created_at=T0, **ev())
        newer = repo.record_evidence(s, dev.id, created_at=T0 + timedelta(minutes=1),
                                     **ev(strategy=BASE, strategy_key="baseline", reps=0, speedup=None,
                                          speedup_lo=None, speedup_hi=None, tried=[]))
        q = repo.record_evidence(s, dev.id, created_at=T0, **ev(problem="q" * 64))
        elsewhere = repo.record_evidence(s, dev.id, created_at=T0, **ev(program="b" * 16))
        repo.record_evidence(s, other.id, created_at=T0, **ev())
    with database.session(read_only=True) as s:
        got = repo.get_evidence(s, "dev-a", "a" * 16)
        assert [(e.id, e.problem_key) for e in got] == [(newer.id, "p" * 64), (q.id, "q" * 64)]
        assert got[0].strategy == BASE and got[0].tried == () and got[0].device_key == "dev-a"
        assert got[1].tried[0]["speedup_lo"] == 1.03 and got[1].previous == BASE
        assert {e.id for e in repo.get_evidence(s, "dev-a")} == {newer.id, q.id, elsewhere.id}
        assert repo.get_evidence(s, "nobody") == []
        assert len(repo.list_evidence(s)) == 4


def test_evidence_is_checked_on_write(database: Database) -> None:
    with database.session() as s:
        dev = add_device(s)
        with pytest.raises(ValueError, match="program_key"):
            repo.record_evidence(s, dev.id, **ev(program="x" * 65))
        with pytest.raises(ValueError, match="reps"):
            repo.record_evidence(s, dev.id, **ev(reps=-1))
        with pytest.raises(NotFoundError, match="device 999"):
            repo.record_evidence(s, 999, **ev())


def test_a_bench_run_keeps_its_attribution(database: Database) -> None:
    row = {"key": "p" * 64, "name": "bsd,df->bsf", "count": 2, "isolated_saved_s": 0.001, "alone_saved_s": 0.004,
           "alone_lo_s": 0.002, "alone_hi_s": 0.006, "without_saved_s": -0.001, "without_lo_s": None,
           "without_hi_s": None}
    with database.session() as s:
        dev = add_device(s)
        with_att = repo.record_model_bench(s, dev.id, **bench_values(attribution=[row]))
        without = repo.record_model_bench(s, dev.id, **bench_values())
    with database.session(read_only=True) as s:
        assert repo.get_model_bench(s, with_att.id).attribution == (row,)
        assert repo.get_model_bench(s, without.id).attribution is None

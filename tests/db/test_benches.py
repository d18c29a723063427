"""Bench-model runs in the database (issue 15 item 5): the 0007 migration keeps a 0006 database,
record/get/list round trips on SQLite and PostgreSQL, and the checks on write."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import text

from db import (
    Database,
    NotFoundError,
    SchemaError,
    current_revision,
    downgrade,
    head_revision,
    make_engine,
    upgrade,
)
from db import repository as repo

from .test_repository import add_device

T0 = datetime(2026, 12, 4, 6, 0, tzinfo=UTC)
PAIR = {"names": ["layers/attn/q_proj"], "key": "a" * 64, "strategy": "ring-uni-c1-u1-loop-send", "count": 2,
        "baseline_s": 0.004, "strategy_s": 0.003, "comm_s": 0.002, "comp_s": 0.0015, "ratio": 1.33,
        "ratio_lo": 1.2, "ratio_hi": 1.4, "failed": None, "saved_s": 0.002}


def bench_values(**overrides: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "program": "autotuner.examples.transformer:train_step", "kwargs": {"layers": 1},
        "target": "lab:shared:2:2gbit", "mesh": {"model": 2}, "strategy": "auto", "reps": 20,
        "plain_s": 0.020, "plain_lo_s": 0.019, "plain_hi_s": 0.021,
        "overlapped_s": 0.016, "overlapped_lo_s": 0.015, "overlapped_hi_s": 0.017,
        "speedup": 1.25, "speedup_lo": 1.18, "speedup_hi": 1.31, "slower": False, "rel_error": 1e-6,
        "pairs": [PAIR], "comm_s": 0.008, "decomposed_comm_s": 0.004, "predicted_saved_s": 0.002,
        "host": "h"}
    values.update(overrides)
    return values


def test_record_get_and_list_bench_runs(database: Database) -> None:
    with database.session() as s:
        dev, other = add_device(s), add_device(s, key="dev-b")
        first = repo.record_model_bench(s, dev.id, created_at=T0, **bench_values())
        loss = repo.record_model_bench(s, dev.id, created_at=T0 + timedelta(minutes=1), **bench_values(
            program="m:f", kwargs={}, mesh=None, overlapped_s=0.025, speedup=0.8, speedup_lo=0.75,
            speedup_hi=0.85, slower=True, predicted_saved_s=-0.001, pairs=[]))
        repo.record_model_bench(s, other.id, created_at=T0 + timedelta(minutes=2), **bench_values())
    assert first.device_key == "dev-a" and first.pairs == (PAIR,) and first.slower is False
    assert math_close(first.measured_saved_s, 0.004) and math_close(first.comm_share or 0, 0.4)
    with database.session(read_only=True) as s:
        got = repo.get_model_bench(s, first.id)
        assert got == first and got is not None and got.created_at == T0
        got.pairs[0]["names"].append("changed")  # a copy: the database keeps its own
        assert repo.get_model_bench(s, first.id).pairs == (PAIR,)  # type: ignore[union-attr]
        assert repo.get_model_bench(s, 9999) is None
        assert [(b.device_key, b.program) for b in repo.list_model_benches(s)] == [
            ("dev-b", "autotuner.examples.transformer:train_step"), ("dev-a", "m:f"),
            ("dev-a", "autotuner.examples.transformer:train_step")]
        mine = repo.list_model_benches(s, "dev-a", program="m:f")
        assert [b.id for b in mine] == [loss.id]
        assert mine[0].slower is True and mine[0].mesh is None and mine[0].predicted_saved_s == -0.001
        assert len(repo.list_model_benches(s, limit=1)) == 1
        assert repo.list_model_benches(s, "no-such-device") == []


def math_close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-12 + 1e-9 * abs(b)


@pytest.mark.parametrize(("bad", "message"), [
    ({"slower": 1}, "slower must be true or false"),
    ({"plain_s": -1.0}, "plain_s must be >= 0"),
    ({"speedup": float("nan")}, "speedup must be finite"),
    ({"pairs": [1.0]}, "pairs[0] must be a JSON object"),
    ({"program": "x" * 513}, "program is longer than 512"),
    ({"reps": 0}, "reps must be an integer >= 1"),
    ({"typo": 1}, "unknown fields ['typo']"),
])
def test_a_bench_run_is_checked_on_write(database: Database, bad: dict[str, Any], message: str) -> None:
    with database.session() as s:
        dev = add_device(s)
        with pytest.raises(ValueError, match=__import__("re").escape(message)):
            repo.record_model_bench(s, dev.id, **bench_values(**bad))
        with pytest.raises(NotFoundError, match="device 999"):
            repo.record_model_bench(s, 999, **bench_values())


def test_0007_and_later_keep_a_0006_database(empty_db_url: str) -> None:
    engine = make_engine(empty_db_url)
    try:
        upgrade(empty_db_url, "0006")
        with engine.begin() as conn:
            conn.execute(text(
                "INSERT INTO devices (key, platform, device_kind, num_devices, num_processes, topology, "
                "jax_version, jaxlib_version, created_at) VALUES ('dev-a', 'cpu', 'cpu', 2, 2, NULL, '1', '1', "
                "CURRENT_TIMESTAMP)"))
        upgrade(empty_db_url)   # 0007 (model_benches), 0008 (its attribution column)
        assert current_revision(engine) == head_revision()
        with Database(empty_db_url) as database, database.session() as s:
            dev = repo.get_device_by_key(s, "dev-a")
            assert dev is not None
            repo.record_model_bench(s, dev.id, **bench_values())
        with Database(empty_db_url) as database, database.session(read_only=True) as s:
            assert [b.program for b in repo.list_model_benches(s)] == [bench_values()["program"]]
        with pytest.raises(SchemaError, match="below 0007 would drop model_benches"):
            downgrade(empty_db_url, "0005")   # a bench run is a result: refused, nothing changed
        with engine.begin() as conn:
            conn.execute(text("DELETE FROM model_benches"))
        downgrade(empty_db_url, "0005")
        assert current_revision(engine) == "0005"
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM devices")).scalar_one() == 1
            tables = conn.dialect.get_table_names(conn)
        assert "model_benches" not in tables
    finally:
        engine.dispose()

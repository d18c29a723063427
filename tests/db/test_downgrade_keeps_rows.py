"""Migrations never lose data (issue 38): a database with a row in every table walks down every
revision and up again on both backends. A downgrade that would drop a table of results (a
calibration, a failure, a bench run, step evidence; at 0001 the results themselves) refuses,
naming it and changing nothing; every other step keeps every row of every table it keeps (on
SQLite its batch mode recreates tables by copy, drop and rename, and with foreign keys on the
drop once cascaded to every measurement and winner)."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import inspect, text

from autotuner import Device, Problem, Strategy
from autotuner.tune.store import device_values, problem_values
from db import (
    Database,
    SchemaError,
    current_revision,
    downgrade,
    head_revision,
    make_engine,
    upgrade,
)
from db import repository as repo
from service.testing import measurements, problem
from tests.db.test_benches import bench_values
from tests.db.test_evidence import ev

RING = Strategy("ring", "uni", 1, "full", "loop", True)
DEVICE = Device("cpu", "cpu", 2, 2, "lab-shared-2gbit", "0.10.2", "0.10.2")
# the result tables each revision adds, which its downgrade refuses to drop while they hold rows
RESULTS_OF = {"0002": {"calibrations"}, "0004": {"failures"}, "0007": {"model_benches"},
              "0008": {"step_evidence"}}


def seed(url: str) -> None:
    """One row (or more) in every table of the head schema."""
    p1, p2 = Problem.from_dict(problem()), Problem.from_dict(problem(m=4096))
    with Database(url) as database, database.session() as s:
        dev = repo.upsert_device(s, **device_values(DEVICE))
        rec1 = repo.upsert_problem(s, **problem_values(p1, name="mlp up"))
        rec2 = repo.upsert_problem(s, **problem_values(p2))
        items = measurements(1.3, RING.to_dict())
        items[1].update(strategy_key=RING.key, serial_s=7e-4, traffic_speedup=1.1)
        items[0]["strategy_key"] = "baseline"
        repo.record_measurements(s, dev.id, rec1.id, items)
        repo.recompute_winner(s, dev.id, rec1.id)            # a winner, a generation, a change
        repo.record_failure(s, dev.id, rec2.id, error="boom")
        repo.enqueue_job(s, problem_key=p2.key, problem=p2.canonical(), device_key=DEVICE.key,
                         device=DEVICE.to_dict())
        repo.record_miss(s, DEVICE.key, DEVICE.to_dict(), p2.key, p2.canonical())
        repo.add_token(s, "ci", "secret-token-value", "write")
        repo.add_calibration(s, dev.id, model="costmodel-v1", params={"alpha": 1e-4})
        repo.record_model_bench(s, dev.id, **bench_values())
        repo.record_evidence(s, dev.id, **ev(problem=p1.key))


def counts(engine: Any) -> dict[str, int]:
    with engine.connect() as conn:
        tables = [t for t in inspect(conn).get_table_names() if t != "alembic_version"]
        return {t: conn.execute(text(f'SELECT count(*) FROM "{t}"')).scalar_one() for t in tables}


@pytest.mark.slow
def test_every_revision_down_and_up_keeps_every_row_or_refuses(empty_db_url: str) -> None:
    upgrade(empty_db_url)
    seed(empty_db_url)
    engine = make_engine(empty_db_url)
    try:
        seeded = counts(engine)
        assert all(n > 0 for n in seeded.values()), seeded   # every table has a row
        revisions = [f"{i:04d}" for i in range(int(head_revision()), 0, -1)]
        for above, below in zip(revisions, revisions[1:], strict=False):
            results = RESULTS_OF.get(above, set())
            if results:
                with pytest.raises(SchemaError, match=f"downgrading below {above} would drop"):
                    downgrade(empty_db_url, below)
                assert current_revision(engine) == above and counts(engine) == {
                    t: n for t, n in seeded.items() if t in counts(engine)}   # nothing changed
                with engine.begin() as conn:   # what the message asks: keep them elsewhere, then delete
                    for t in results:
                        conn.execute(text(f'DELETE FROM "{t}"'))
                seeded = {t: (0 if t in results else n) for t, n in seeded.items()}
            downgrade(empty_db_url, below)
            assert current_revision(engine) == below
            now = counts(engine)
            assert now == {t: n for t, n in seeded.items() if t in now}, (below, now, seeded)
        with pytest.raises(SchemaError, match="downgrading below 0001 would drop devices"):
            downgrade(empty_db_url, "base")
        upgrade(empty_db_url)
        back = counts(engine)
        assert {t: back[t] for t in ("devices", "problems", "measurements", "winners", "tuning_jobs", "demand",
                                     "tokens")} == {t: seeded[t] for t in ("devices", "problems", "measurements",
                                                                          "winners", "tuning_jobs", "demand",
                                                                          "tokens")}
        with Database(empty_db_url) as database, database.session(read_only=True) as s:
            w = repo.get_winner(s, DEVICE.key, Problem.from_dict(problem()).key)
            assert w is not None and w.strategy_key == RING.key   # the result survived the round trip
    finally:
        engine.dispose()


def all_rows(url: str) -> dict[str, list[dict[str, Any]]]:
    from db.export import export_rows

    with Database(url) as database:
        return export_rows(database)["tables"]


@pytest.mark.slow
def test_export_then_import_into_an_empty_database_gives_identical_rows(
        empty_db_url: str, tmp_path: Any, request: pytest.FixtureRequest, backend: str) -> None:
    """`autotuner db export FILE` then `autotuner db import FILE` into an empty database: every row
    of every table identical, ids included; the ids go on after them; an import into a database
    that is not empty, or of a file that is not an export, is refused with one line."""
    from typer.testing import CliRunner

    from autotuner.cli import app

    upgrade(empty_db_url)
    seed(empty_db_url)
    runner = CliRunner()
    out = tmp_path / "backup.json.gz"
    r = runner.invoke(app, ["db", "export", str(out), "--db", empty_db_url])
    assert r.exit_code == 0 and "exported" in r.output, r.output
    if backend == "sqlite":
        target = f"sqlite:///{tmp_path / 'restored.db'}"   # created by the import
    else:
        pg = request.getfixturevalue("pg_server")
        target = pg.url_for(pg.create())
        upgrade(target)
    r = runner.invoke(app, ["db", "import", str(out), "--db", target])
    assert r.exit_code == 0 and "imported" in r.output, r.output
    before, after = all_rows(empty_db_url), all_rows(target)
    assert after == before and all(before.values()), [t for t in before if before[t] != after.get(t)]
    with Database(target) as database, database.session() as s:   # new rows get new ids
        assert repo.upsert_device(s, **device_values(Device("cpu", "cpu", 4, 1, "x", "1", "1"))).id > 1
    r = runner.invoke(app, ["db", "import", str(out), "--db", target])
    assert r.exit_code == 2 and "not empty" in r.output and "Traceback" not in r.output, r.output
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    r = runner.invoke(app, ["db", "import", str(bad), "--db", target])
    assert r.exit_code == 2 and "not an autotuner database export" in r.output, r.output

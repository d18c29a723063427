"""Failed problems (issue 14 item 2) and problem names (item 5) in the database: the 0004
migration keeps old rows, record/list/clear failures, a problem's first name sticks."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from db import Database, NotFoundError, current_revision, downgrade, make_engine, upgrade
from db import repository as repo

from .test_repository import _beside, add_device, add_problem


def test_record_list_and_clear_a_failure(database: Database) -> None:
    with database.session() as s:
        dev, prob = add_device(s), add_problem(s)
        other = add_problem(s, key="prob-b", m=64)
        first = repo.record_failure(s, dev.id, prob.id, name="attn/q_proj", error="ValueError: one", run_id="r1")
        assert (first.device_key, first.problem_key, first.name) == ("dev-a", "prob-a", "attn/q_proj")
        repo.record_failure(s, dev.id, prob.id, name="attn/q_proj", error="ValueError: two", host="h")
        repo.record_failure(s, dev.id, other.id, error="RuntimeError: three")
    with database.session(read_only=True) as s:
        got = repo.list_failures(s)
        assert [(f.problem_key, f.error) for f in got] == [("prob-b", "RuntimeError: three"),
                                                           ("prob-a", "ValueError: two")]
        assert repo.list_failures(s, "no-such-device") == []
    with database.session() as s:
        assert repo.clear_failure(s, dev.id, prob.id) is True
        assert repo.clear_failure(s, dev.id, prob.id) is False
    with database.session(read_only=True) as s:
        assert [f.problem_key for f in repo.list_failures(s, "dev-a")] == ["prob-b"]


def test_two_failures_of_one_pair_at_once_leave_one(database: Database) -> None:
    """Two uploads say the same pair failed at the same moment: the later replaces the earlier
    (on PostgreSQL both deleted nothing and the second insert broke the pair's unique constraint)."""
    with database.session() as s:
        dev, prob = add_device(s), add_problem(s)
    first, second = _beside(database, lambda s: repo.record_failure(s, dev.id, prob.id, error="one").error,
                            lambda s: repo.record_failure(s, dev.id, prob.id, error="two").error)
    assert (first, second) == ("two", "one")
    with database.session(read_only=True) as s:
        assert [f.error for f in repo.list_failures(s)] == ["two"]


def test_a_failure_needs_an_error_and_existing_rows(database: Database) -> None:
    with database.session() as s:
        dev, prob = add_device(s), add_problem(s)
        with pytest.raises(ValueError, match="error"):
            repo.record_failure(s, dev.id, prob.id, name="x")
        with pytest.raises(NotFoundError, match="problem 999"):
            repo.record_failure(s, dev.id, 999, error="e")


def test_a_problem_keeps_its_first_name(database: Database) -> None:
    with database.session() as s:
        assert add_problem(s).name is None
        named = repo.upsert_problem(s, **{**_values(repo.get_problem_by_key(s, "prob-a")), "name": "mlp/up_proj"})
        assert named.name == "mlp/up_proj"
        again = repo.upsert_problem(s, **{**_values(named), "name": "mlp/gate_proj"})
        assert again.name == "mlp/up_proj" and again.id == named.id


def _values(p):  # noqa: ANN001, ANN202 - a ProblemRecord back to upsert_problem's keywords
    return {k: getattr(p, k) for k in ("key", "canonical", "equation", "pattern", "dtype", "mesh_size",
                                       "m", "n", "k", "b", "flops", "comm_bytes", "name")}


def test_0004_keeps_a_0003_database(empty_db_url: str) -> None:
    engine = make_engine(empty_db_url)
    try:
        upgrade(empty_db_url, "0003")
        with engine.begin() as conn:
            conn.execute(text(
                "INSERT INTO problems (key, canonical, equation, pattern, dtype, mesh_size, m, n, k, b, flops, "
                "comm_bytes, lm, ln, lk, lb, created_at) VALUES ('p', '{}', 'ab,bc->ac', 'all_gather:lhs:free', "
                "'float32', 2, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, CURRENT_TIMESTAMP)"))
        upgrade(empty_db_url)
        with Database(empty_db_url) as database, database.session(read_only=True) as s:
            p = repo.get_problem_by_key(s, "p")
            assert p is not None and p.name is None
            assert repo.list_failures(s) == []
        downgrade(empty_db_url, "0003")
        assert current_revision(engine) == "0003"
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM problems")).scalar_one() == 1
    finally:
        engine.dispose()

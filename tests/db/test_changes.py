"""The winners' generation counter and change log (db/_changes.py), on SQLite and PostgreSQL."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from db import Database, StorageError
from db import repository as repo
from db._changes import KEEP_GENERATIONS
from db.tables import WinnerChange
from tests.db.test_repository import add_device, add_problem, item

BASE = {"method": "baseline"}
RING = {"method": "ring", "direction": "uni", "chunks": 1}


def _store(database: Database, dkey: str, pkeys: list[str], ratio: float = 1.3) -> None:
    with database.session() as s:
        dev = add_device(s, dkey)
        for pkey in pkeys:
            prob = add_problem(s, pkey)
            repo.record_measurements(s, dev.id, prob.id, [
                item(BASE, median=0.010), item(RING, median=0.010 / ratio, ratio=ratio,
                                              lo=ratio - 0.05, hi=ratio + 0.05)])
            repo.recompute_winner(s, dev.id, prob.id)


def test_every_winner_write_is_one_generation_with_its_keys(database: Database) -> None:
    with database.session(read_only=True) as s:
        g0 = repo.current_generation(s)
        assert repo.changes_since(s, g0) == repo.Changes(g0, ())
    _store(database, "dev-a", ["p1", "p2"])  # one transaction, two winners: one generation
    _store(database, "dev-b", ["p1"])
    with database.session() as s:
        dev = repo.get_device_by_key(s, "dev-a")
        assert dev is not None
        repo.add_calibration(s, dev.id, model="costmodel-v1", params={"a": 1})
    with database.session(read_only=True) as s:
        assert repo.current_generation(s) == g0 + 3
        got = repo.changes_since(s, g0)
        assert got.complete and got.generation == g0 + 3
        assert got.items == (("dev-a", "p1"), ("dev-a", "p2"), ("dev-b", "p1"), ("dev-a", None))
        assert repo.changes_since(s, g0 + 2).items == (("dev-a", None),)
        assert repo.changes_since(s, g0 + 3) == repo.Changes(g0 + 3, ())


def test_a_rolled_back_transaction_changes_nothing(database: Database) -> None:
    with database.session(read_only=True) as s:
        g0 = repo.current_generation(s)
    with pytest.raises(StorageError), database.session() as s:
        dev = add_device(s, "dev-a")
        prob = add_problem(s, "p1")
        repo.recompute_winner(s, dev.id, prob.id)
        raise StorageError("abandon")
    _store(database, "dev-a", ["p2"])
    with database.session(read_only=True) as s:
        got = repo.changes_since(s, g0)
    assert got.items == (("dev-a", "p2"),) and got.generation == g0 + 1


def test_a_reader_behind_the_kept_generations_is_told_to_drop_everything(database: Database) -> None:
    _store(database, "dev-a", ["p1"])
    with database.session() as s:  # as if KEEP_GENERATIONS commits had pruned the first one
        g = repo.current_generation(s)
        s.execute(WinnerChange.__table__.delete())
    _store(database, "dev-a", ["p2"])
    with database.session(read_only=True) as s:
        got = repo.changes_since(s, g - 1)
        assert not got.complete and got.generation == g + 1
        assert repo.changes_since(s, g).complete
        assert list(s.execute(select(WinnerChange.generation)).scalars()) == [g + 1]
    assert KEEP_GENERATIONS >= 1000

"""The in-memory nearest index (service/nearest.py) finds what repository.nearest_winners
finds, and is read again after a winner of its device changes."""

from __future__ import annotations

import pytest

from autotuner import Device, Problem
from autotuner.tune import store
from db import Database
from db import repository as repo
from service.nearest import NearestIndex
from service.testing import DEVICE, measurements, problem
from tests.service.test_bench import _module
from tests.service.test_coherence import _items


@pytest.mark.slow
def test_the_index_agrees_with_the_database_search(db_url):
    fill_db = _module("fill_db")
    with Database(db_url) as database:
        fill_db.fill(database, 1500)
        device = fill_db.bench_device()
        tuned = list(fill_db.problems(1500))
        keys = {p.key for p in tuned}
        asked = tuned[:40] + [p for p in fill_db.problems(400, seed=5) if p.key not in keys][:120]
        index = NearestIndex(max_distance=2.0, limit=5)
        with database.session(read_only=True) as s:
            got = index.neighbors(s, device.key, [(p.key, p) for p in asked])
            found = 0
            for p in asked:
                f = p.features()
                want = repo.nearest_winners(s, device.key, pattern=p.pattern.label, dtype=p.dtype,
                                            mesh_size=p.axis_size, m=f["m"], n=f["n"], k=f["k"],
                                            b=f["b"], limit=5, exclude_key=p.key, max_distance=2.0)
                assert [k for k, _ in got[p.key]] == [w.winner.problem_key for w in want], p.key
                assert [d for _, d in got[p.key]] == pytest.approx([w.distance for w in want])
                found += bool(want)
        assert found > 50  # the comparison is not vacuous
        assert index.loads <= 2 * 3 * 4  # one read per (dtype, mesh size, pattern) group


def test_a_dropped_device_is_read_again(db_url):
    device, p = Device.from_dict(DEVICE), Problem.from_dict(problem())
    near = Problem.from_dict(problem(m=4096))
    index = NearestIndex(max_distance=2.0)
    with Database(db_url) as database:
        with database.session(read_only=True) as s:
            assert index.neighbors(s, device.key, [(near.key, near)]) == {near.key: []}
        from autotuner.tune import store
        from service.testing import measurements
        from tests.service.test_coherence import _items

        store.save(database, device, p, _items(measurements(1.25)))
        with database.session(read_only=True) as s:  # still the group read before the winner
            assert index.neighbors(s, device.key, [(near.key, near)]) == {near.key: []}
        index.drop(device.key)
        with database.session(read_only=True) as s:
            assert [k for k, _ in index.neighbors(s, device.key, [(near.key, near)])[near.key]] == [p.key]


def test_a_group_not_read_yet_is_searched_in_the_database_meanwhile(db_url):
    device, p = Device.from_dict(DEVICE), Problem.from_dict(problem())
    near = Problem.from_dict(problem(m=4096))
    with Database(db_url) as database:
        store.save(database, device, p, _items(measurements(1.25)))
        index = NearestIndex(max_distance=2.0, database=database)
        try:
            with database.session(read_only=True) as s:
                first = index.neighbors(s, device.key, [(near.key, near)])
            index.wait()
            assert index.loads == 1
            with database.session(read_only=True) as s:
                assert index.neighbors(s, device.key, [(near.key, near)]) == first
            assert index.loads == 1 and [k for k, _ in first[near.key]] == [p.key]
        finally:
            index.close()


def test_preload_and_a_change_rereads_only_its_group(db_url):
    device = Device.from_dict(DEVICE)
    ag, rs = Problem.from_dict(problem()), Problem.from_dict(problem(kind="rs"))
    with Database(db_url) as database:
        for p in (ag, rs):
            store.save(database, device, p, _items(measurements(1.25)))
        index = NearestIndex(max_distance=2.0, database=database)
        try:
            assert index.preload() == 2
            index.wait()
            assert index.loads == 2
            new = Problem.from_dict(problem(m=4096))  # same group as `ag`
            store.save(database, device, new, _items(measurements(1.25)))
            index.changed([(device.key, new.key)])
            index.wait()
            assert index.loads == 3  # the ag group only
            asked = Problem.from_dict(problem(m=8192))
            with database.session(read_only=True) as s:
                got = index.neighbors(s, device.key, [(asked.key, asked)])[asked.key]
            assert [k for k, _ in got] == [new.key, ag.key] and index.loads == 3
        finally:
            index.close()

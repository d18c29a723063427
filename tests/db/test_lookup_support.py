"""What the service's lookup path reads and writes in bulk: record_misses (demand counted per
(device, problem) in one upsert) and tuned_group (the rows of an in-memory nearest index)."""

from __future__ import annotations

import pytest

from db import Database
from db import repository as repo
from tests.db.test_repository import add_device, add_problem, item

BASE = {"method": "baseline"}
RING = {"method": "ring", "direction": "uni", "chunks": 1}


def test_record_misses_counts_like_record_miss(database: Database) -> None:
    dev = {"platform": "cpu"}
    with database.session() as s:
        repo.record_miss(s, "d", dev, "p1", {"x": 1})
        assert repo.record_misses(s, [("d", dev, "p1", {"x": 1}, 3), ("d", dev, "p2", {"x": 2}, 2)]) == 5
        repo.record_misses(s, [("d", dev, "p2", {"x": 2}, 1)])
    with database.session(read_only=True) as s:
        got = {d.problem_key: d.count for d in repo.list_demand(s)}
    assert got == {"p1": 4, "p2": 3}
    with pytest.raises(ValueError, match="count"), database.session() as s:
        repo.record_misses(s, [("d", dev, "p3", {"x": 3}, 0)])


def test_tuned_group_lists_the_tuned_problems_of_one_group_on_one_device(database: Database) -> None:
    with database.session() as s:
        a, b = add_device(s, "dev-a"), add_device(s, "dev-b")
        probs = [add_problem(s, f"p{i}", m=2048 * (i + 1)) for i in range(3)]
        other = add_problem(s, "other-dtype", dtype="float32")
        for dev, prob in [(a, probs[0]), (a, probs[2]), (b, probs[1]), (a, other)]:
            repo.record_measurements(s, dev.id, prob.id, [item(BASE, median=0.01),
                                                          item(RING, median=0.008, ratio=1.25,
                                                               lo=1.2, hi=1.3)])
            repo.recompute_winner(s, dev.id, prob.id)
        pattern = probs[0].pattern
    with database.session(read_only=True) as s:
        rows = repo.tuned_group(s, "dev-a", pattern=pattern, dtype="bfloat16", mesh_size=8)
        assert [r[1] for r in rows] == ["p0", "p2"]
        assert rows[1][2] == pytest.approx(repo.log_feature(2048 * 3))
        assert repo.tuned_group(s, "nope", pattern=pattern, dtype="bfloat16", mesh_size=8) == []

"""The dashboard's aggregates (db._stats through db.repository), on SQLite and PostgreSQL."""

from __future__ import annotations

from typing import Any

import pytest

from db import repository as repo

BASELINE = {"method": "baseline"}
UNI = {"method": "ring", "direction": "uni", "chunks": 1}
BIDI = {"method": "ring", "direction": "bidi", "chunks": 2}


def _device(s: Any, key: str, kind: str = "cpu") -> Any:
    return repo.upsert_device(s, key=key, platform="cpu", device_kind=kind, num_devices=4,
                              num_processes=4, topology="lab-ring-1gbit", jax_version="0.10.2",
                              jaxlib_version="0.10.2")


def _problem(s: Any, key: str, *, pattern: str = "all_gather:lhs:free", dtype: str = "float32",
             m: float = 1024, flops: float = 1e9, comm_bytes: float = 1e6) -> Any:
    canonical = {"equation": "ab,bc->ac", "lhs": {"shape": [m, 64], "spec": ["x", None]},
                 "rhs": {"shape": [64, 64], "spec": [None, None]}, "out_spec": [None, None],
                 "dtype": dtype, "mesh": {"x": 4}}
    return repo.upsert_problem(s, key=key, canonical=canonical, equation="mk,kn->mn",
                               pattern=pattern, dtype=dtype, mesh_size=4, m=m, n=64, k=64, b=1,
                               flops=flops, comm_bytes=comm_bytes)


def _tune(s: Any, device: Any, problem: Any, ratio: float, strategy: dict[str, Any]) -> Any:
    base = 1e-3
    items = [{"strategy": BASELINE, "strategy_key": "baseline", "status": "ok",
              "samples": [base] * 5, "median_s": base}]
    if strategy is not BASELINE:
        items.append({"strategy": strategy, "strategy_key": f"{strategy['method']}-"
                      f"{strategy['direction']}", "status": "ok", "samples": [base / ratio] * 5,
                      "median_s": base / ratio, "ratio": ratio, "ratio_lo": ratio - 0.01,
                      "ratio_hi": ratio + 0.01})
    repo.record_measurements(s, device.id, problem.id, items)
    return repo.recompute_winner(s, device.id, problem.id)


@pytest.fixture
def seeded(database: Any) -> Any:
    """Two devices; on `a`: 4 problems (1 baseline win, 2 uni, 1 bidi), on `b`: 1 problem."""
    with database.session() as s:
        a, b = _device(s, "dev-a"), _device(s, "dev-b", kind="TPU v4")
        p = [_problem(s, f"p{i}", m=256 * (i + 1), flops=1e9 * (i + 1), comm_bytes=1e6 * (i + 1),
                      pattern="reduce_scatter:free_lhs" if i == 3 else "all_gather:lhs:free",
                      dtype="bfloat16" if i == 2 else "float32")
             for i in range(5)]
        _tune(s, a, p[0], 1.0, BASELINE)
        _tune(s, a, p[1], 1.12, UNI)
        _tune(s, a, p[2], 1.149, UNI)
        _tune(s, a, p[3], 3.7, BIDI)
        _tune(s, b, p[4], 1.3, UNI)
        repo.enqueue_job(s, problem_key="p5", problem={"x": 1}, device_key="dev-a", device={})
        repo.enqueue_job(s, problem_key="p6", problem={"x": 2}, device_key="dev-a", device={})
        job = repo.claim_job(s, "w", 60)
        assert job is not None
        repo.finish_job(s, job.id, "w", "done")
    return database


def test_tuned_counts(seeded):
    with seeded.session() as s:
        rows = repo.tuned_counts(s)
    got = [(r.device_key, r.pattern, r.problems, r.decomposed, r.best_speedup) for r in rows]
    assert got == [("dev-a", "all_gather:lhs:free", 3, 2, pytest.approx(1.149)),
                   ("dev-a", "reduce_scatter:free_lhs", 1, 1, pytest.approx(3.7)),
                   ("dev-b", "all_gather:lhs:free", 1, 1, pytest.approx(1.3))]
    assert rows[2].device_kind == "TPU v4" and rows[0].num_devices == 4


def test_speedup_histogram(seeded):
    with seeded.session() as s:
        bins = repo.speedup_histogram(s, width=0.05, upper=3.0)
        only_b = repo.speedup_histogram(s, device_key="dev-b")
        nothing = repo.speedup_histogram(s, device_key="no-such-device")
        with pytest.raises(ValueError, match="bins"):
            repo.speedup_histogram(s, width=0.001, upper=10)
        with pytest.raises(ValueError):
            repo.speedup_histogram(s, width=0)
    got = [(b.lo, b.hi, b.method, b.direction, b.count) for b in bins]
    assert got == [
        (1.0, 1.05, "baseline", None, 1),
        (1.1, 1.15, "ring", "uni", 2),          # 1.12 and 1.149: same bin
        (1.3, 1.35, "ring", "uni", 1),
        (3.0, None, "ring", "bidi", 1),         # 3.7 lands in the open-ended last bin
    ]
    assert [(b.lo, b.count) for b in only_b] == [(1.3, 1)]
    assert nothing == []


def test_speedup_histogram_bin_edges(database):
    with database.session() as s:
        d = _device(s, "dev")
        for i, r in enumerate((1.15, 1.2, 0.95)):
            _tune(s, d, _problem(s, f"q{i}"), r, UNI)
        # a ring winner below 1 cannot come from the rule, but the histogram does not care
        bins = repo.speedup_histogram(s, width=0.05, upper=2.0)
    assert {b.lo for b in bins} <= {1.0, 1.15, 1.2}  # 0.95 loses to the baseline (1.0)
    assert [b.lo for b in bins if b.method == "ring"] == [1.15, 1.2]


def test_shape_sample(seeded):
    with seeded.session() as s:
        full = repo.shape_sample(s)
        thin = repo.shape_sample(s, limit=2)
        only_b = repo.shape_sample(s, device_key="dev-b")
        with pytest.raises(ValueError):
            repo.shape_sample(s, limit=0)
    assert full.total == 5 and full.stride == 1 and len(full.points) == 5
    first = full.points[0]
    assert (first.device_key, first.method, first.direction, first.speedup) == (
        "dev-a", "baseline", None, 1.0)
    assert [(p.method, p.direction) for p in full.points[1:4]] == [
        ("ring", "uni"), ("ring", "uni"), ("ring", "bidi")]
    assert full.points[3].comm_bytes == 4e6 and full.points[3].flops == 4e9
    assert thin.total == 5 and thin.stride == 3 and 1 <= len(thin.points) <= 2
    assert [p.problem_id for p in only_b.points] == [full.points[4].problem_id]


def test_facets_jobs_and_winners(seeded):
    with seeded.session() as s:
        facets = repo.problem_facets(s)
        counts = repo.job_counts(s)
        problem = repo.get_problem_by_key(s, "p1")
        assert problem is not None
        winners = repo.problem_winners(s, problem.id)
        none = repo.problem_winners(s, 10_000)
    assert facets.patterns == ("all_gather:lhs:free", "reduce_scatter:free_lhs")
    assert facets.dtypes == ("bfloat16", "float32")
    assert facets.methods == ("baseline", "ring")
    assert counts == {"queued": 1, "running": 0, "done": 1, "failed": 0}
    assert [(w.device_key, w.problem_key, w.method) for w in winners] == [("dev-a", "p1", "ring")]
    assert none == []


def test_empty_database(database):
    with database.session() as s:
        assert repo.tuned_counts(s) == []
        assert repo.speedup_histogram(s) == []
        sample = repo.shape_sample(s)
        assert (sample.points, sample.total, sample.stride) == ((), 0, 1)
        assert repo.problem_facets(s) == repo.Facets((), (), ())
        assert set(repo.job_counts(s).values()) == {0}

"""Grouped problems through the harness and the tuner (inproc): every candidate checked against the
baseline on each of its k results, the bound's parts timed, results stored under the group's key."""

from __future__ import annotations

import jax
import pytest

import autotuner.decompose.grouped_allgather as grouped_mod
from autotuner import GroupedProblem, Strategy, space
from autotuner.measure import LocalRunner, run_session

QKV = {"einsums": [
    {"equation": "bsd,dhk->bshk", "lhs": {"shape": [2, 16, 32], "spec": [None, "x", None]},
     "rhs": {"shape": [32, 4, 8], "spec": [None, "x", None]}, "out_spec": [None, None, "x", None],
     "dtype": "float32", "mesh": {"x": 4}},
    {"equation": "dhk,bsd->bshk", "lhs": {"shape": [32, 8, 8], "spec": [None, "x", None]},
     "rhs": {"shape": [2, 16, 32], "spec": [None, "x", None]}, "out_spec": [None, None, "x", None],
     "dtype": "float32", "mesh": {"x": 4}},
    {"equation": "bsd,df->bsf", "lhs": {"shape": [2, 16, 32], "spec": [None, "x", None]},
     "rhs": {"shape": [32, 12], "spec": [None, "x"]}, "out_spec": [None, None, "x"],
     "dtype": "float32", "mesh": {"x": 4}},
]}


def mesh4() -> jax.sharding.Mesh:
    return jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])


def test_every_strategy_runs_and_checks_in_one_session() -> None:
    gp = GroupedProblem.from_dict(QKV)
    strategies = space(gp)
    assert len(strategies) > 10
    res = run_session(LocalRunner(mesh4(), warmup=1), gp, strategies, reps=3)
    bad = [(c.key, c.reason) for c in [res.baseline, *res.candidates] if c.status != "ok"]
    assert bad == []
    assert all(c.error is not None and c.error <= 2e-5 for c in res.candidates)
    assert res.comm_s is not None and res.comp_s is not None and res.bound_s is not None
    assert res.problem == gp.to_dict()


def test_a_wrong_member_result_fails_its_candidate(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check covers every result of the group, not only the first."""
    gp = GroupedProblem.from_dict(QKV)
    real = grouped_mod.local_ring

    def broken(problem, s):
        fn = real(problem, s)
        return lambda *a: tuple(o * 2 if m == 2 else o for m, o in enumerate(fn(*a)))

    monkeypatch.setattr(grouped_mod, "local_ring", broken)
    ring = Strategy("ring", "uni", 1, "full", "loop", True)
    res = run_session(LocalRunner(mesh4(), warmup=1), gp, [Strategy.baseline(), ring], reps=2, parts=False)
    assert res.baseline.status == "ok"
    assert res.candidates[0].status == "failed" and "numerics mismatch" in (res.candidates[0].reason or "")


def _on_eight() -> dict:
    """QKV on a mesh of 8 (the test process has 8 devices): the heads and features doubled."""
    import copy

    d = copy.deepcopy(QKV)
    for m in d["einsums"]:
        m["mesh"] = {"x": 8}
        w = "rhs" if m["equation"].startswith("bsd") else "lhs"
        m[w]["shape"] = [m[w]["shape"][0], *[2 * v for v in m[w]["shape"][1:2]], *m[w]["shape"][2:]]
    return d


def test_tune_stores_the_group_under_its_key(tmp_path) -> None:
    from autotuner.measure.targets import Target, TargetSession
    from autotuner.tune.search import tune_problem
    from db import Database
    from db import repository as repo
    from db.tables import Problem as ProblemRow

    database = Database(f"sqlite:///{tmp_path / 'g.db'}")
    database.upgrade()
    gp = GroupedProblem.from_dict(QKV)
    with TargetSession(Target.parse("inproc:8")) as ts:
        eight = GroupedProblem.from_dict(_on_eight())
        r = tune_problem(ts, database, eight, trials=4, reps=3, seed=0, aa=False)  # no A/A twin needed
        assert r.trials == 4
        with database.session(read_only=True) as s:
            w = repo.get_winner(s, ts.device.key, eight.key)
            row = s.query(ProblemRow).filter_by(key=eight.key).one()
        assert w is not None and (w.method == "baseline" or w.speedup_lo > 1.0)
        assert row.pattern == "all_gather_group3:free" and row.canonical == eight.canonical()
        assert row.equation == "bsd,dhk->bshk;dhk,bsd->bshk;bsd,df->bsf"
    assert gp.key != eight.key
    database.dispose()

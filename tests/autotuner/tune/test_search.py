"""The Optuna tuner: budgets, no duplicate measurements, resume after SIGKILL, parallel workers."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autotuner import Problem, space
from autotuner.measure.targets import Target, TargetSession
from autotuner.tune.search import tune_problem

P8 = {"equation": "sd,df->sf", "lhs": {"shape": [128, 32], "spec": ["x", None]},
      "rhs": {"shape": [32, 64], "spec": [None, "x"]}, "out_spec": [None, "x"],
      "dtype": "float32", "mesh": {"x": 8}}
P4 = {"equation": "sf,fd->sd", "lhs": {"shape": [128, 64], "spec": [None, "x"]},
      "rhs": {"shape": [64, 32], "spec": ["x", None]}, "out_spec": ["x", None],
      "dtype": "float32", "mesh": {"x": 4}}


def measured_keys(db_url_or_path, sql_conn=None) -> list[str]:
    from sqlalchemy import select

    from db import Database
    from db.tables import Measurement

    database = Database(str(db_url_or_path))
    with database.session(read_only=True) as s:
        keys = [k for (k,) in s.execute(select(Measurement.strategy_key).order_by(Measurement.id))]
    database.dispose()
    return keys


def searched(keys: list[str]) -> list[str]:
    """The ring strategies a search measured, from every measurement's key in storage order: less,
    for each serial control, the last measurement of its ring, which tune_problem measures once more
    beside that control when a ring wins (on inproc devices only by timing noise; each call, and
    each worker, that measured something does so)."""
    rings = [k for k in keys if k.startswith("ring")]
    for control in [k for k in keys if k.startswith("serial")]:
        ring = "ring" + control[len("serial"):]
        assert ring in rings, keys
        del rings[len(rings) - 1 - rings[::-1].index(ring)]
    return rings


def test_budget_dedupe_resume_and_winner_rule(tmp_path):
    from db import Database
    from db import repository as repo

    url = f"sqlite:///{tmp_path / 'r.db'}"
    database = Database(url)
    database.upgrade()
    p = Problem.from_dict(P8)
    with TargetSession(Target.parse("inproc:8")) as ts:  # no A/A twin: not what this checks
        r1 = tune_problem(ts, database, p, trials=5, reps=3, seed=1, aa=False)
        assert r1.trials == 5 and r1.studied == 5
        r2 = tune_problem(ts, database, p, trials=9, reps=3, seed=1, aa=False)   # resumes the same study
        assert r2.trials == 4 and r2.studied == 9
    keys = searched(measured_keys(url))
    assert len(keys) == 9 and len(set(keys)) == 9
    assert measured_keys(url).count("plain") == 2   # measured beside each call's first batch
    assert set(keys) <= {s.key for s in space(p)}
    with database.session(read_only=True) as s:
        w = repo.get_winner(s, ts.device.key, p.key)
    assert w is not None
    # never a regression: a decomposition only wins with its whole CI above 1
    assert w.method == "baseline" or w.speedup_lo > 1.0
    database.dispose()


def test_a_calibrated_device_measures_the_cost_models_picks_first(tmp_path):
    import dataclasses

    from autotuner import costmodel
    from db import Database

    url = f"sqlite:///{tmp_path / 'm.db'}"
    database = Database(url)
    database.upgrade()
    p = Problem.from_dict(P8)
    gbit = 1e9 / 8
    params = costmodel.Params(mm=tuple((f, f / 20e9) for f in (1e6, 1e9, 1e11)), mem_bw=1e10,
                              ag=(1e-4, 1 / (2 * gbit)), rs=(1e-4, 1 / (2 * gbit)), alpha=1e-5,
                              beta_uni=1 / (2 * gbit), beta_bidi=1 / (4 * gbit), kappa=0.0,
                              kappa_x=0.0, loop_s=1e-4, copy_bw=1e10, num_devices=8)
    with TargetSession(Target.parse("inproc:8")) as ts:
        costmodel.save_params(database, ts.device, params)
        ring = [s for s in space(p, ts.device) if s.method == "ring"]
        top = [s.key for s in costmodel.ranker(params, p)(ring)][:2]
        tune_problem(ts, database, p, trials=6, reps=3, seed=3, aa=False)  # the order, not the A/A
        first = [k for k in measured_keys(url) if k.startswith("ring")][:2]
        assert first == top
        # without the model (or without a calibration) the search does not start there
        other = dataclasses.replace(ts.device, topology="uncalibrated")
        assert costmodel.order_for(database, other, p) is None
    database.dispose()


def _worker_cmd(problems: Path, db: str, trials: int, target: str) -> list[str]:
    return [sys.executable, "-m", "autotuner.cli", "tune", "--problems", str(problems), "--target", target,
            "--trials", str(trials), "--reps", "3", "--db", db, "--json"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_")}
    env.update(extra)
    return env


@pytest.mark.slow
def test_sigkilled_worker_resumes_without_losing_measurements(tmp_path):
    problems = tmp_path / "p.json"
    problems.write_text(json.dumps(P4))
    db = f"sqlite:///{tmp_path / 'k.db'}"
    env = _env(AUTOTUNER_TRIAL_LEASE_SECONDS="2")
    cmd = _worker_cmd(problems, db, 14, "inproc:4")
    log = open(tmp_path / "worker1.log", "w+")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 240
    before: list[str] = []
    while time.time() < deadline:
        time.sleep(0.5)
        if (tmp_path / "k.db").exists():
            try:
                before = measured_keys(db)
            except Exception:  # noqa: BLE001 - schema not created yet
                continue
            if len([k for k in before if k.startswith("ring")]) >= 4:
                break
    alive = proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    log.seek(0)
    output = log.read()
    log.close()
    assert alive, output
    before = measured_keys(db)
    with sqlite3.connect(tmp_path / "k.db") as c:
        before_ids = {i for (i,) in c.execute("select id from measurements")}
    time.sleep(2.5)  # let the dead worker's trial leases run out
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr
    after = measured_keys(db)
    with sqlite3.connect(tmp_path / "k.db") as c:
        after_ids = {i for (i,) in c.execute("select id from measurements")}
        winners = list(c.execute("select count(*) from winners"))
    assert before_ids <= after_ids                                  # nothing finished was lost
    cands = searched(after)
    assert len(cands) == 14 and len(set(cands)) == 14                # resumed to the budget, no repeats
    assert [k for k in before if k.startswith("ring")] == cands[: len([k for k in before if k.startswith("ring")])]
    assert winners == [(1,)]


@pytest.mark.slow
@pytest.mark.postgres
def test_four_workers_share_one_postgres_study(tmp_path, pg_url):
    problems = tmp_path / "p.json"
    problems.write_text(json.dumps(P4))
    subprocess.run([sys.executable, "-m", "autotuner.cli", "db", "upgrade", "--db", pg_url], check=True,
                   env=_env(), capture_output=True, timeout=120)
    cmd = _worker_cmd(problems, pg_url, 12, "inproc:4")
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for _ in range(4)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_out, err) in zip(procs, outs, strict=True):
        text = err.decode()
        assert p.returncode == 0, text
        assert "deadlock" not in text.lower() and "could not obtain lock" not in text.lower()
    cands = searched(measured_keys(pg_url))
    assert len(cands) == 12 and len(set(cands)) == 12               # no trial measured twice
    from sqlalchemy import func, select

    from db import Database
    from db.tables import Winner

    database = Database(pg_url)
    with database.session(read_only=True) as s:
        assert s.execute(select(func.count()).select_from(Winner)).scalar_one() == 1
    database.dispose()

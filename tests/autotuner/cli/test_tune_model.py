"""`autotuner tune-model`: the isolated search's winners refined in the whole step (real
subprocesses, in-process devices: timings are noise here, so these check the mechanism: what is
timed, what is stored, that a rerun times nothing again, and that `plan` rests on the stored
evidence). The keep/reject rule itself: tests/autotuner/tune/test_refine.py."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import text

from autotuner.strategy import Strategy
from db import Database
from db import repository as repo

from .test_plan import TINY, run

RING = Strategy("ring", "uni", 1, "full", "loop", True)


@pytest.mark.slow
def test_tune_model_times_close_candidates_in_the_step_stores_resumes_and_plan_uses_it(tmp_path):
    (tmp_path / "tiny.py").write_text(TINY)
    url = f"sqlite:///{tmp_path / 't.db'}"
    r = run(["tune-model", "tiny:program", "--target", "inproc:2", "--db", url, "--trials", "2",
             "--tune-reps", "3", "--reps", "5", "--json"], tmp_path)
    assert r.returncode == 0, r.stderr
    first = json.loads(r.stdout.splitlines()[-1])
    (unit,) = first["units"]
    assert "$ autotuner tune" in r.stderr and len(first["program_key"]) == 16
    # the isolated ranking put RING close to the winner (a measurement as a tuner's session stores it)
    database = Database(url)
    with database.session() as s:
        dev = repo.get_device_by_key(s, first["device_key"])
        prob = repo.get_problem_by_key(s, unit["key"])
        repo.record_measurements(s, dev.id, prob.id, [{
            "strategy": RING.to_dict(), "strategy_key": RING.key, "status": "ok", "samples": [1e-3] * 3,
            "median_s": 1e-3, "iqr_s": 0.0, "min_s": 1e-3, "n": 3, "ratio": 1.0, "ratio_lo": 0.9, "ratio_hi": 1.1}])
    database.dispose()
    r = run(["tune-model", "tiny:program", "--target", "inproc:2", "--db", url, "--skip-tune", "--reps", "5",
             "--json"], tmp_path)
    assert r.returncode == 0, r.stderr
    # the first run's evidence is for this program and problem: resumed, nothing timed again
    assert "1 with stored evidence" in r.stderr and "not timed again" in r.stderr
    with Database(url).session(read_only=True) as s:
        (ev,) = repo.get_evidence(s, dev.key, first["program_key"])
    assert ev.problem_key == unit["key"]
    # a fresh program key (other evidence) is refined: the candidate is timed in the step
    with Database(url).session() as s:
        s.execute(text("DELETE FROM step_evidence"))
    r = run(["tune-model", "tiny:program", "--target", "inproc:2", "--db", url, "--skip-tune", "--reps", "5",
             "--json"], tmp_path)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.splitlines()[-1])
    (e,) = got["evidence"]
    # RING, and whatever the real isolated search put close to the winner (at most 2 besides baseline)
    tried = [t["strategy_key"] for t in e["tried"]]
    assert e["reps"] == 5 and RING.key in tried and len(tried) <= 3
    assert e["changed"] == (e["speedup_lo"] is not None and e["speedup_lo"] > 1)
    best = max(e["tried"], key=lambda t: t["speedup"])["strategy_key"]
    assert e["strategy"] == (best if e["changed"] else e["previous"])
    assert len(got["refined_speedup"]) == 3 and "in the step" in r.stderr
    with Database(url).session(read_only=True) as s:
        (ev,) = repo.get_evidence(s, dev.key, got["program_key"])
    assert ev.reps == 5 and [t["strategy_key"] for t in ev.tried] == tried
    # plan --db rests on it, and says so
    r = run(["plan", "tiny:program", "--db", url, "--json"], tmp_path)
    assert r.returncode == 0, r.stderr
    (row,) = [json.loads(x) for x in r.stdout.splitlines()]
    assert row["source"] == "in-program" and "in-program evidence (tune-model)" in row["note"]
    # (a ring the evidence chose may still be shed by the memory bound, and the note says so)
    assert row["strategy"] == e["strategy"] or row["note"].startswith("the memory bound")


def test_a_target_of_another_size_than_the_programs_mesh_is_one_line(tmp_path):
    """TINY's mesh has 2 devices: on inproc:4 every problem would fail in the isolated search
    (a line each, then "nothing was refined"); the command says so once, after the extract,
    before anything is tuned."""
    (tmp_path / "tiny.py").write_text(TINY)
    r = run(["tune-model", "tiny:program", "--target", "inproc:4", "--db", f"sqlite:///{tmp_path / 't.db'}"], tmp_path)
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "the problems' mesh needs 2 devices; target inproc:4 has 4" in last and "--mesh of 4" in last, r.stderr
    assert "$ autotuner tune " not in r.stderr, r.stderr   # nothing was tuned

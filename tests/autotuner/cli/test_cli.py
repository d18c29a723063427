"""`autotuner tune`: problems files, JSON output, the database, clear errors (real subprocesses)."""

from __future__ import annotations

import json
import math
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

SMALL = {"equation": "sd,df->sf", "lhs": {"shape": [64, 32], "spec": ["x", None]},
         "rhs": {"shape": [32, 64], "spec": [None, "x"]}, "out_spec": [None, "x"],
         "dtype": "float32", "mesh": {"x": 2}}
SMALL_RS = {"equation": "sf,fd->sd", "lhs": {"shape": [64, 32], "spec": [None, "x"]},
            "rhs": {"shape": [32, 16], "spec": ["x", None]}, "out_spec": ["x", None],
            "dtype": "float32", "mesh": {"x": 2}}


def run(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "AUTOTUNER_DB"))}
    return subprocess.run([sys.executable, "-m", "autotuner.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def rows(db: Path, sql: str) -> list[tuple]:
    with sqlite3.connect(db) as c:
        return list(c.execute(sql))


@pytest.mark.slow
def test_tune_exhaustive_json_and_database(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps(SMALL) + "\n" + json.dumps(SMALL_RS) + "\n")
    # --precision 0: exactly --reps repetitions (the adaptive ones are test_tune_quality's); no
    # --target: on a CPU host the default is in-process devices, as many as the problems' mesh has
    # (it was inproc:8, which JAX, started to look for a GPU/TPU, could no longer give)
    r = run(["tune", "--problems", str(f), "--exhaustive", "--reps", "3", "--precision", "0", "--json"], tmp_path)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert len(lines) == 2
    for line in lines:
        assert set(line) >= {"key", "problem", "device", "winner", "speedup", "baseline_s", "winner_s",
                             "bound_s", "efficiency", "trials", "seconds", "failed"}
        assert line["device"]["topology"] == "inproc" and line["device"]["num_devices"] == 2
        assert line["failed"] == 0 and line["winner"]["method"] in ("baseline", "plain", "ring")
        # every ring beside its serial control: its speedup = traffic x overlap, from one session
        rings = [c for c in line["candidates"] if c["key"].startswith("ring-")]
        controls = [c for c in line["candidates"] if c["key"].startswith("serial-")]
        assert rings and len(controls) == len(rings)
        for c in rings:
            assert c["serial_s"] > 0 and math.isclose(c["traffic_speedup"] * c["overlap_speedup"], c["speedup"],
                                                      rel_tol=1e-9), c
        if line["winner"]["method"] == "ring":
            assert math.isclose(line["traffic_speedup"] * line["overlap_speedup"], line["speedup"], rel_tol=1e-9)
        else:
            assert line["traffic_speedup"] is None and line["overlap_speedup"] is None
    assert "tuned" in r.stderr                                  # the summary table
    db = tmp_path / "autotuner.db"
    assert rows(db, "select count(*) from winners") == [(2,)]
    n_meas = rows(db, "select count(*) from measurements")[0][0]
    assert n_meas == lines[0]["trials"] + lines[1]["trials"]
    # the database keeps each ring's split (its control's, the control itself has none), and a
    # winner its own measurement's: what the service, the dashboard and the plan show
    split = {(line["key"], c["key"]): (c["serial_s"], c["traffic_speedup"]) for line in lines
             for c in line["candidates"] if c["key"].startswith("ring-")}
    stored = rows(db, "select p.key, m.strategy_key, m.serial_s, m.traffic_speedup, m.method from measurements m "
                      "join problems p on p.id = m.problem_id")
    assert {(k, s): (a, b) for k, s, a, b, m in stored if m == "ring"} == split
    assert all(a is None and b is None for *_, a, b, m in stored if m != "ring")
    winners = dict(rows(db, "select p.key, w.traffic_speedup from winners w join problems p on p.id = w.problem_id"))
    assert winners == {line["key"]: line["traffic_speedup"] for line in lines}


@pytest.mark.slow
def test_tune_search_respects_the_trial_budget(tmp_path):
    f = tmp_path / "p.json"
    p = dict(SMALL, mesh={"x": 4}, lhs={"shape": [64, 32], "spec": ["x", None]},
             rhs={"shape": [32, 64], "spec": [None, "x"]})
    f.write_text(json.dumps([p]))
    r = run(["tune", "--problems", str(f), "--target", "inproc:4", "--trials", "6", "--reps", "3",
             "--precision", "0", "--json"], tmp_path)
    assert r.returncode == 0, r.stderr
    line = json.loads(r.stdout)
    assert line["trials"] == 6
    # the row's times and its speedup come from one session (the search times the baseline in
    # every batch; the row's baseline is the winner's own batch's)
    assert line["speedup"] == pytest.approx(line["baseline_s"] / line["winner_s"], rel=1e-9)
    db = tmp_path / "autotuner.db"
    keys = [k for (k,) in rows(db, "select strategy_key from measurements where strategy_key like 'ring%'")]
    assert len(keys) == 6 and len(set(keys)) == 6              # nothing measured twice
    # plain (what jax.jit makes of the einsum) is measured beside the study's trials, once
    assert [k for (k,) in rows(db, "select strategy_key from measurements where strategy_key = 'plain'")] == ["plain"]
    assert [c["key"] for c in line["candidates"]][:1] == ["baseline"] and "plain" in [c["key"] for c in line["candidates"]]
    optuna_tables = {t for (t,) in rows(tmp_path / "autotuner.optuna.db", "select name from sqlite_master")}
    our_tables = {t for (t,) in rows(db, "select name from sqlite_master")}
    assert "studies" in optuna_tables and "measurements" not in optuna_tables  # Optuna's apart from ours
    assert "studies" not in our_tables and "measurements" in our_tables


BAD_FILES = [
    ("bad.json", '{"equation": "ij,jk->ik",\n "lhs": }', "bad.json: invalid JSON at line 2"),
    ("bad.yaml", "- equation: ij,jk->ik\n  lhs: [unclosed\n", "bad.yaml: invalid YAML at line"),
    ("bad.jsonl", json.dumps(SMALL) + "\n" + json.dumps(dict(SMALL, dtype="int4")) + "\n",
     "bad.jsonl: line 2: dtype: unsupported dtype"),
    ("bad2.json", json.dumps([SMALL, dict(SMALL, lhs={"shape": [63, 32], "spec": ["x", None]})]),
     "bad2.json: item 1: lhs.shape[0]"),
    ("bad.yml", "equation: ij,jk->ik\nlhs: {shape: [4, 4]}\n", "bad.yml: item 0: mesh: missing field"),
    ("empty.json", "", "empty.json: the file is empty"),
]


@pytest.mark.parametrize("name, text, message", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_bad_problems_file_names_file_item_and_field(tmp_path, name, text, message):
    f = tmp_path / name
    f.write_text(text)
    r = run(["tune", "--problems", str(f), "--target", "inproc:2", "--exhaustive"], tmp_path, timeout=60)
    assert r.returncode == 2
    assert message in " ".join(r.stderr.split()), r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "autotuner.db").exists()             # nothing half written


def test_bad_target_and_missing_file(tmp_path):
    r = run(["tune", "--target", "gpu:9", "--exhaustive"], tmp_path, timeout=60)
    assert r.returncode == 2 and "expected inproc:N" in r.stderr and "Traceback" not in r.stderr
    r = run(["tune", "--problems", str(tmp_path / "nope.json"), "--target", "inproc:2"], tmp_path, timeout=60)
    assert r.returncode == 2 and "nope.json: cannot read" in r.stderr


def test_mesh_larger_than_target_is_a_clear_error(tmp_path):
    """A problem the target cannot run fails alone: recorded, summarised, exit 1 (issue 14 item 2)."""
    f = tmp_path / "p.json"
    f.write_text(json.dumps(dict(SMALL, mesh={"x": 8}, lhs={"shape": [64, 32], "spec": ["x", None]},
                                 rhs={"shape": [32, 64], "spec": [None, "x"]})))
    r = run(["tune", "--problems", str(f), "--target", "inproc:2", "--exhaustive"], tmp_path, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.splitlines()[-1].startswith("0 tuned, 1 failed: p.json[0]: the problem's mesh {'x': 8} needs 8")


@pytest.mark.parametrize("argv,message", [
    (["serve", "--db", "mysql://u:secret@h/x"], "unsupported database URL 'mysql://u:***@h/x'"),
    (["db", "upgrade", "--db", "postgresql://u:secret@h:port/x"], "'postgresql+psycopg://u:***@h:port/x' does not parse"),
    (["snapshot", "--service", "autotuner:8000", "--all", "--out", "s.json"],
     "service URL 'autotuner:8000': expected http(s)://HOST[:PORT]"),
])
def test_a_bad_url_is_one_line(tmp_path, argv, message):
    """A URL of a database this project does not run on, or one that does not parse, or a service
    URL without its scheme: one line naming it, a password hidden (`serve` and `plan` printed a
    traceback for the database URL)."""
    r = run(argv, tmp_path, timeout=120)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "secret" not in r.stderr, r.stderr


def test_stale_schema_names_the_upgrade_command(tmp_path):
    db = tmp_path / "old.db"
    with sqlite3.connect(db) as c:
        c.execute("create table something_else (x int)")
    f = tmp_path / "p.json"
    f.write_text(json.dumps(SMALL))
    r = run(["tune", "--problems", str(f), "--target", "inproc:2", "--exhaustive", "--db", str(db)], tmp_path,
            timeout=120)
    assert r.returncode == 2 and "autotuner db upgrade" in r.stderr and "Traceback" not in r.stderr
    r = run(["db", "upgrade", "--db", str(db)], tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr


def test_ctrl_c_summarises_what_was_tuned(tmp_path):
    """Ctrl-C in the middle of a run: exit 130 with the problems done summarised and stored (it
    ended without a word); interrupted once the second problem's search has begun (its header
    line), never on a timer."""
    import signal

    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps(dict(SMALL, lhs={"shape": [64 * k, 32], "spec": ["x", None]})) + "\n"
                         for k in (1, 2, 3)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "AUTOTUNER_DB"))}
    p = subprocess.Popen([sys.executable, "-m", "autotuner.cli", "tune", "--problems", str(f), "--target", "inproc:2",
                          "--exhaustive", "--reps", "3", "--precision", "0"], cwd=tmp_path, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = []
    assert p.stderr is not None
    for line in p.stderr:
        seen.append(line)
        if sum("strategies" in x for x in seen) == 2:   # the first problem is done, the second begun
            p.send_signal(signal.SIGINT)
            break
    rest = p.stderr.read()
    p.stderr.close()
    assert p.wait(timeout=120) == 130, "".join(seen) + rest
    assert "interrupted after 1 of 3 problem(s)" in rest and "Traceback" not in rest, rest
    assert rows(tmp_path / "autotuner.db", "select count(distinct problem_id) from measurements") == [(1,)]

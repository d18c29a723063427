"""`autotuner tune` shows how trustworthy its figures are: the A/A width in the table, the --json
line and the stored measurements; --precision and --precision-seconds drive the repetitions."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

SMALL = {"equation": "sd,df->sf", "lhs": {"shape": [64, 32], "spec": ["x", None]},
         "rhs": {"shape": [32, 64], "spec": [None, "x"]}, "out_spec": [None, "x"],
         "dtype": "float32", "mesh": {"x": 2}}


def run(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "AUTOTUNER_DB"))}
    return subprocess.run([sys.executable, "-m", "autotuner.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def rows(db: Path, sql: str) -> list[tuple]:
    with sqlite3.connect(db) as c:
        return list(c.execute(sql))


@pytest.mark.slow
def test_tune_reports_and_stores_the_aa_width(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps(SMALL))
    r = run(["tune", "--problems", str(f), "--target", "inproc:2", "--exhaustive", "--reps", "3",
             "--precision-seconds", "2", "--json"], tmp_path)
    assert r.returncode == 0, r.stderr
    line = json.loads(r.stdout)
    lo, hi = line["aa_ci"]
    assert lo <= hi and line["aa_width"] == pytest.approx(max(1 - lo, hi - 1, 0.0))
    assert "A/A +/-" in r.stderr and f"{line['aa_width'] * 100:.1f}%" in r.stderr   # the table
    stored = rows(tmp_path / "autotuner.db", "select strategy_key, aa_width from measurements")
    assert len(stored) == line["trials"]        # every strategy of the space, not the A/A twin
    assert all(w == pytest.approx(line["aa_width"]) for _k, w in stored)


@pytest.mark.slow
def test_tune_without_aa_and_with_fixed_repetitions(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps(SMALL))
    r = run(["tune", "--problems", str(f), "--target", "inproc:2", "--exhaustive", "--reps", "3",
             "--precision", "0", "--no-aa", "--json"], tmp_path)
    assert r.returncode == 0, r.stderr
    line = json.loads(r.stdout)
    assert line["aa_width"] is None and line["aa_ci"] is None
    stored = rows(tmp_path / "autotuner.db", "select n, aa_width from measurements")
    assert stored and all(n == 3 and w is None for n, w in stored)   # exactly --reps, no A/A
    bad = run(["tune", "--problems", str(f), "--target", "inproc:2", "--precision", "2"], tmp_path,
              timeout=60)
    assert bad.returncode == 2 and "--precision" in bad.stderr

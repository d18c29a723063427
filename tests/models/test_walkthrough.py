"""A new user's walk-through on each real model: `autotuner extract` its sequence-parallel training
step, then `autotuner tune --target inproc:4` every problem of the file (real subprocesses)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
# Issue 14 item 1: the harness times the collective alone wrapped in the problem's out_spec, which
# has the einsum output's rank, not the gathered operand's (e.g. abc,cde->abde), and item 2: that
# crash aborts the batch. The test asserts the goal and reports exactly this failure as xfail.
KNOWN_CRASH = "was given an out_specs entry which is too long"


def run(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "AUTOTUNER_DB"))}
    return subprocess.run([sys.executable, "-m", "autotuner.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(("module", "library"), [("penzai_llama", "penzai"), ("keras_hub_llama", "keras_hub")])
def test_extract_then_tune_every_problem(tmp_path: Path, module: str, library: str) -> None:
    if importlib.util.find_spec(library) is None:
        pytest.skip(f"{library} is not installed: install requirements-models.lock (`make test` does)")
    problems = tmp_path / "problems.json"
    r = run(["extract", f"tests.models.{module}:train_step_sp", "--mesh", '{"data": 2, "model": 2}',
             "--auto", "-o", str(problems)])
    assert r.returncode == 0, r.stderr
    doc = json.loads(problems.read_text())
    assert len(doc["problems"]) == 8 and sum(doc["counts"]) == 22      # as test_<lib>.py counts (11L)

    r = run(["tune", "--problems", str(problems), "--target", "inproc:4", "--trials", "6",
             "--reps", "3", "--json", "--db", f"sqlite:///{tmp_path / 'a.db'}"])
    if r.returncode != 0 and KNOWN_CRASH in r.stderr:
        pytest.xfail("issue 14 items 1-2: the harness crashes on a rank-changing all-gather problem "
                     "and the crash aborts the batch")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert sorted(x["key"] for x in lines) == sorted(doc["keys"])
    assert all(x["winner"] is not None for x in lines)

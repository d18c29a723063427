"""A new user's walk-through on each real model (issue 14 item 6): `autotuner extract` a factory
(Auto mesh, the default), then `autotuner tune --target inproc:4` every problem of the file (real
subprocesses). Every problem ends with a winner or a recorded failure whose reason is a real
limitation, never a crash; the rows carry the readable names extraction gave them."""

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
MESH = '{"data": 2, "model": 2}'
# (distinct problems, occurrences) as test_<library>.py counts them by hand
FILES = {"train_step_sp": (8, 22), "forward_sp": (4, 8)}   # grouped gathers: 11L and 4L, L = 2


def run(args: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "AUTOTUNER_DB"))}
    env["KERAS_BACKEND"] = "jax"
    return subprocess.run([sys.executable, "-m", "autotuner.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def need(library: str) -> None:
    if importlib.util.find_spec(library) is None:
        pytest.skip(f"{library} is not installed: install requirements-models.lock (`make test` does)")


LIBS = [("penzai_llama", "penzai"), ("keras_hub_llama", "keras_hub")]


@pytest.mark.parametrize(("module", "library"), LIBS)
def test_extract_then_tune_every_problem(tmp_path: Path, module: str, library: str) -> None:
    """Both factories extracted; the training step's problems tuned. The forward's problems are
    the training step's first four (the same keys and names), so tuning them again would time the
    same candidates twice."""
    need(library)
    docs = {}
    for factory, want in FILES.items():
        problems = tmp_path / f"{factory}.json"
        r = run(["extract", f"tests/models/{module}.py:{factory}", "--mesh", MESH, "-o", str(problems)])
        assert r.returncode == 0, r.stderr
        doc = docs[factory] = json.loads(problems.read_text())
        assert (len(doc["problems"]), sum(doc["counts"])) == want
        assert all(doc["names"]) and len(set(doc["names"])) == len(doc["names"])
        if factory.startswith("train_step"):   # the weight gradients: skipped, each with its reason
            assert r.stderr.count("needs an all-reduce over data") == 14
    fwd, doc = docs["forward_sp"], docs["train_step_sp"]
    assert fwd["keys"] == doc["keys"][:len(fwd["keys"])] and fwd["names"] == doc["names"][:len(fwd["names"])]

    r = run(["tune", "--problems", str(tmp_path / "train_step_sp.json"), "--target", "inproc:4", "--trials", "2",
             "--reps", "3", "--precision", "0", "--json", "--db", f"sqlite:///{tmp_path / 'a.db'}"])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["key"] for x in lines] == doc["keys"] and [x["name"] for x in lines] == doc["names"]
    assert all(x["winner"] is not None and x["error"] is None for x in lines)
    assert r.stderr.splitlines()[-1] == f"{len(lines)} tuned, 0 failed"


@pytest.mark.parametrize(("module", "library"), LIBS)
def test_tensor_parallel_only_finds_nothing_and_says_why(module: str, library: str, tmp_path: Path) -> None:
    """Without sequence parallelism every collective is an all-reduce used whole: no problem, and each
    skipped pair is listed with that reason by default."""
    need(library)
    r = run(["extract", f"tests.models.{module}:forward", "--mesh", MESH, "-o", str(tmp_path / "p.json")])
    assert r.returncode == 0, r.stderr
    assert "0 problem(s)" in r.stderr and r.stderr.count("the all-reduce result is used whole") == 4

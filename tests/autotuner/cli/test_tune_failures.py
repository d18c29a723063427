"""A batch survives failure (issue 14 item 2): a problem whose harness raises, or whose every
candidate fails, is recorded in the database with its error, the batch goes on, `tune` ends with
`N tuned, M failed: <name>: <reason>` and exits 1 only when something failed; --json lines show
the failures too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import autotuner.cli.tune  # noqa: F401 - registers `tune` on the app
import autotuner.decompose as strategies_mod
import autotuner.measure as measure_mod
from autotuner import Problem
from autotuner.cli.common import app
from autotuner.cli.tune import summary_line
from db import Database
from db import repository as repo

# On the 8 in-process devices tests/conftest.py sets up: inproc:8 runs these in this process. The
# collective's axis has one device, so the space is the baseline alone (a fast test).
GOOD = {"equation": "bsd,df->bsf", "lhs": {"shape": [8, 16, 32], "spec": ["d", "x", None]},
        "rhs": {"shape": [32, 16], "spec": [None, "x"]}, "out_spec": ["d", None, "x"], "dtype": "float32",
        "mesh": {"d": 8, "x": 1}}
BROKEN = dict(GOOD, rhs={"shape": [32, 8], "spec": [None, "x"]})     # another key; made to fail below
OTHER_MESH = dict(GOOD, mesh={"d": 4, "x": 1})                        # cannot run on inproc:8


def extracted(tmp_path: Path, problems: list[dict], names: list[str]) -> Path:
    """A problems file as `autotuner extract` writes it (with names)."""
    f = tmp_path / "problems.json"
    keys = [Problem.from_dict(p).key for p in problems]
    f.write_text(json.dumps({"source": "t", "counts": [1] * len(problems), "keys": keys, "names": names,
                             "problems": problems}))
    return f


def invoke(f: Path, url: str, *extra: str):  # noqa: ANN201
    return CliRunner().invoke(app, ["tune", "--problems", str(f), "--target", "inproc:8", "--exhaustive",
                                    "--reps", "3", "--json", "--db", url, *extra])


@pytest.mark.parametrize("how", ["harness_raises", "every_candidate_fails"])
def test_a_failing_problem_is_recorded_and_the_batch_goes_on(tmp_path: Path, monkeypatch, how: str) -> None:
    broken_key = Problem.from_dict(BROKEN).key
    if how == "harness_raises":
        real = measure_mod.LocalRunner.add_parts

        def add_parts(self):  # noqa: ANN001, ANN202
            if self.problem.key == broken_key:
                raise RuntimeError("the collective alone does not compile\nsecond line")
            return real(self)

        monkeypatch.setattr(measure_mod.LocalRunner, "add_parts", add_parts)
        reason = "RuntimeError: the collective alone does not compile"
    else:
        real_build = strategies_mod.build

        def build(problem, strategy, mesh):  # noqa: ANN001, ANN202
            if problem.key == broken_key:
                raise ValueError("no such program")
            return real_build(problem, strategy, mesh)

        monkeypatch.setattr(strategies_mod, "build", build)
        reason = "the baseline failed: ValueError: no such program"
    f = extracted(tmp_path, [GOOD, BROKEN, OTHER_MESH, GOOD], ["mlp/up_proj", "attn/q_proj", "x4", "mlp/up_proj#2"])
    url = f"sqlite:///{tmp_path / 'a.db'}"
    res = invoke(f, url)
    assert res.exit_code == 1, res.output
    lines = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
    assert [x["name"] for x in lines] == ["mlp/up_proj", "attn/q_proj", "x4", "mlp/up_proj#2"]
    assert [x["error"] is None for x in lines] == [True, False, False, True]
    assert lines[1]["error"].startswith(reason) and lines[1]["winner"] is None
    assert "needs 4 devices" in lines[2]["error"]
    assert lines[3]["winner"] is not None                       # tuned after the failures
    summary = [x for x in res.stderr.splitlines() if "tuned," in x][-1]
    assert summary.startswith(f"2 tuned, 2 failed: attn/q_proj: {reason}")
    assert "; x4: " in summary and "Traceback" not in res.output
    with Database(url) as database, database.session(read_only=True) as s:
        failures = {f.problem_key: f for f in repo.list_failures(s)}
        assert set(failures) == {broken_key, Problem.from_dict(OTHER_MESH).key}
        assert failures[broken_key].name == "attn/q_proj" and failures[broken_key].error.startswith(reason)
        assert repo.get_problem_by_key(s, Problem.from_dict(GOOD).key).name == "mlp/up_proj"

    # tuned later (nothing broken any more): the failure record goes, and the exit is 0
    monkeypatch.undo()
    res = invoke(extracted(tmp_path, [BROKEN], ["attn/q_proj"]), url)
    assert res.exit_code == 0, res.output
    assert res.stderr.splitlines()[-1] == "1 tuned, 0 failed"
    with Database(url) as database, database.session(read_only=True) as s:
        assert broken_key not in {f.problem_key for f in repo.list_failures(s)}


def test_summary_line() -> None:
    rows = [{"name": "a", "error": None}, {"name": "b", "error": "ValueError: x\n  at y"}]
    assert summary_line(rows) == "1 tuned, 1 failed: b: ValueError: x"
    assert summary_line(rows[:1]) == "1 tuned, 0 failed"

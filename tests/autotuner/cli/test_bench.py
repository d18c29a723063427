"""`autotuner bench-model`: plain vs overlapped on in-process devices, with the per-pair breakdown
(real subprocesses). Timing figures on shared CPU devices are noise: these check the shape of the
result and its consistency, not a speedup."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = ["autotuner.examples.transformer:example", "--explicit", "--kwargs", '{"layers": 1}']


def run(args: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "AUTOTUNER_"))}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "autotuner.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def forced_ring(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, str]:
    """One `bench-model --strategy RING --json --db URL` run, what the two tests below check (its
    JSON; the row it stores): the example is built, compiled and timed once for both."""
    from db import upgrade

    tmp_path = tmp_path_factory.mktemp("forced_ring")
    url = f"sqlite:///{tmp_path / 'results.db'}"
    upgrade(url)
    r = run(["bench-model", *EXAMPLE, "--memory", "none", "--target", "inproc:4", "--strategy", "ring-uni-c1-u1-loop-send",
             "--reps", "5", "--pair-reps", "3", "--attribute", "--profile", "2", "--json", "--db", url], tmp_path)
    return r, url


@pytest.mark.slow
def test_bench_model_forced_ring_json(forced_ring):
    r, _ = forced_ring
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["error"] <= 4e-5 and len(got["plan"]) == 4 and all(p["applied"] for p in got["plan"])
    for name in ("plain", "overlapped"):
        s = got[name]
        assert s["n"] == 5 and len(got[f"{name}_samples"]) == 5 and s["lo_s"] <= s["median_s"] <= s["hi_s"]
    assert math.isclose(got["speedup"], got["plain"]["median_s"] / got["overlapped"]["median_s"])
    # --profile: where each step's time goes, and how much of the saving overlap explains
    for name in ("plain", "overlapped"):
        s, prof = got[name], got["profile"][name]
        assert s["collective_s"] > 0 and s["compute_s"] > 0 and 0 <= s["side_by_side_s"] <= s["collective_s"]
        assert math.isclose(s["side_by_side_s"], prof["overlap_ms"] / 1e3)
    saved = got["profile"]["plain"]["step_ms"] - got["profile"]["overlapped"]["step_ms"]
    if saved > 0:
        assert math.isclose(got["overlap_share"], (got["overlapped"]["side_by_side_s"] - got["plain"]["side_by_side_s"])
                            * 1e3 / saved)
    else:
        assert got["overlap_share"] is None
    assert got["speedup_lo"] <= got["speedup"] <= got["speedup_hi"]
    assert got["slower"] == (got["speedup_hi"] < 1)
    keys = {p["key"] for p in got["plan"]}
    assert {t["key"] for t in got["pairs"]} == keys and sum(t["count"] for t in got["pairs"]) == 4
    for t in got["pairs"]:
        assert t["failed"] is None and t["baseline_s"] > 0 and t["strategy_s"] > 0 and t["comm_s"] > 0
        assert math.isclose(t["saved_s"], t["count"] * (t["baseline_s"] - t["strategy_s"]))
    assert math.isclose(got["comm_s"], sum(t["count"] * t["comm_s"] for t in got["pairs"]))
    # --attribute: one row per decomposed problem, each variant applied exactly what it was asked
    att = got["attribution"]
    assert [a["key"] for a in att] == [p["key"] for p in got["plan"]]
    assert not [n for n in got["notes"] if "the pass applied" in n]
    saved = {t["key"]: t["saved_s"] for t in got["pairs"]}
    for a in att:
        assert set(a) >= {"key", "name", "count", "isolated_saved_s", "alone_saved_s", "alone_lo_s", "alone_hi_s",
                          "without_saved_s"}
        assert a["count"] == 1 and math.isclose(a["isolated_saved_s"], saved[a["key"]])
        assert a["alone_lo_s"] <= a["alone_saved_s"] <= a["alone_hi_s"]
    # --attribute with --profile: each problem's step with only it decomposed is profiled too, and
    # its saving split the same way as the plan's (side by side gained / time saved)
    alone = got["profile"]["alone"]
    assert len(alone) == len(att) and all(p["steps"] == 2 for p in alone)
    base = got["profile"]["plain"]
    for a, prof in zip(att, alone, strict=True):
        gain = base["step_ms"] - prof["step_ms"]
        want = (prof["overlap_ms"] - base["overlap_ms"]) / gain if gain > 0 else None
        assert a["overlap_share"] == (pytest.approx(want) if want is not None else None)
    assert math.isclose(got["alone_sum_saved_s"], sum(a["alone_saved_s"] for a in att))
    assert math.isclose(got["without_sum_saved_s"], sum(a["without_saved_s"] for a in att))
    assert math.isclose(got["measured_saved_s"], got["plain"]["median_s"] - got["overlapped"]["median_s"])


def test_bench_model_baseline_table_and_errors(tmp_path):
    r = run(["bench-model", *EXAMPLE, "--target", "inproc:4", "--strategy", "baseline", "--reps", "5",
             "--pair-reps", "3"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "0 of 4 pair(s) decomposed" in r.stdout and "speedup" in r.stdout
    assert "no pair is decomposed" in r.stdout
    # the pairs are still timed alone, for their collectives' share of the step
    breakdown = r.stdout.split("pairs, each timed alone")[1].split("collectives alone, all pairs:")
    assert len(breakdown) == 2
    assert len(re.findall(r"^\s+[0-9a-f]{12}\s+baseline\s+1\s", breakdown[0], re.M)) == 4
    bad = run(["bench-model", *EXAMPLE, "--target", "gpu:9"], tmp_path)
    assert bad.returncode == 2 and "expected inproc:N" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.lab
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_model_on_a_lab_builds_the_program_in_every_process(tmp_path):
    """lab:none:2 (plain loopback, no root needed): the factory runs in both processes, the
    numerics are checked across them, both programs are timed and each pair alone."""
    r = run(["bench-model", "autotuner.examples.transformer:train_step", "--memory", "none", "--mesh", '{"model": 2}', "--explicit",
             "--kwargs", '{"layers": 1}', "--target", "lab:none:2", "--strategy", "ring-uni-c2-ufull-loop-send",
             "--reps", "5", "--pair-reps", "3", "--json"], tmp_path)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["error"] <= 4e-5 and got["plain"]["n"] == got["overlapped"]["n"] == 5
    applied = [p for p in got["plan"] if p["applied"]]
    # forward 4 + backward 8 pairs, 1 layer: the 4 weight gradients read the kept copy of the
    # all-gather they share with a forward dot or an input gradient
    served = [p for p in got["plan"] if p["note"].startswith("served by the gathered value")]
    assert [p for p in got["plan"] if p["served_by"]] == served
    assert sum(t["count"] for t in got["pairs"] if t["strategy"] == "served") == 4
    assert len(got["plan"]) == 12 and len(applied) == 8 and len(served) == 4
    assert sum(t["count"] for t in got["pairs"]) == 12 and all(t["failed"] is None for t in got["pairs"])


def test_bench_model_stores_its_result_with_db(forced_ring, tmp_path):
    """--db: the run becomes one row of model_benches holding what --json prints (issue 15 item 5);
    --no-store keeps it out."""
    from db import Database
    from db import repository as repo

    r, url = forced_ring
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert f"stored as bench-model run {got['bench_id']}" in r.stderr
    with Database(url) as database, database.session(read_only=True) as s:
        (row,) = repo.list_model_benches(s)
        device = repo.get_device_by_key(s, row.device_key)
    assert row.id == got["bench_id"] and device is not None and device.num_devices == 4
    assert (row.program, row.kwargs, row.target, row.mesh, row.strategy, row.reps) == (
        "autotuner.examples.transformer:example", {"layers": 1}, "inproc:4", None, "ring-uni-c1-u1-loop-send", 5)
    assert (row.plain_s, row.plain_lo_s, row.plain_hi_s) == (
        got["plain"]["median_s"], got["plain"]["lo_s"], got["plain"]["hi_s"])
    assert (row.overlapped_s, row.speedup, row.speedup_lo, row.speedup_hi, row.slower) == (
        got["overlapped"]["median_s"], got["speedup"], got["speedup_lo"], got["speedup_hi"], got["slower"])
    assert list(row.pairs) == got["pairs"] and len(row.pairs) == 4
    assert (row.comm_s, row.predicted_saved_s, row.rel_error) == (got["comm_s"], got["predicted_saved_s"],
                                                                  got["error"])
    again = run(["bench-model", *EXAMPLE, "--target", "inproc:4", "--strategy", "baseline", "--reps", "5",
                 "--no-pairs", "--json", "--db", url, "--no-store"], tmp_path)
    assert again.returncode == 0, again.stderr
    assert "bench_id" not in json.loads(again.stdout)
    with Database(url) as database, database.session(read_only=True) as s:
        assert len(repo.list_model_benches(s)) == 1


@pytest.mark.slow
def test_a_forced_ring_on_the_example_step_with_an_auto_mesh_runs_to_its_result(tmp_path):
    """`--mesh` without `--explicit` gives the example an Auto mesh (GSPMD places its collectives);
    the forced ring is applied where it fits, the rest stay plain, and the run ends with its
    result (it once died in the example's own layout code: 'layout not decomposed: letter h ...')."""
    r = run(["bench-model", "autotuner.examples.transformer:train_step", "--kwargs", '{"layers": 1}',
             "--target", "inproc:2", "--mesh", '{"model": 2}', "--strategy", "ring-uni-c1-ufull-loop-send",
             "--reps", "5", "--no-store", "--json"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    assert got["error"] <= 4e-5 and got["speedup"] > 0
    applied = [p for p in got["plan"] if p["applied"]]
    assert applied and all(p["source"] == "forced" for p in got["plan"])
    assert all(p["note"] for p in got["plan"] if not p["applied"])   # each pair left alone says why

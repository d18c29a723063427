"""The load benchmark's tools: the bulk generator keeps the repository's invariants, and the
benchmark runs end to end (tiny)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from db import Database
from db import repository as repo

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCH))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


def _snapshot(database: Database) -> dict[str, tuple]:
    with database.session(read_only=True) as s:
        out = {}
        for row in repo.list_problems(s, tuned_only=False, limit=1000).items:
            p, w = row.problem, row.winner
            ms = repo.list_measurements(s, p.id)
            assert w is not None
            near = repo.nearest_winners(s, w.device_key, pattern=p.pattern, dtype=p.dtype,
                                        mesh_size=p.mesh_size, m=p.m, n=p.n, k=p.k, b=p.b, limit=1)
            out[p.key] = (p.canonical, p.pattern, p.flops, p.comm_bytes, w.strategy, w.speedup, w.speedup_lo,
                          w.baseline_s, w.winner_s, w.trials, len(w.measurement_ids),
                          [(m.strategy_key, m.median_s, m.samples, m.ratio_lo) for m in ms],
                          near[0].distance)
        return out


def test_bulk_fill_equals_the_repository_path(db_url, tmp_path):
    fill_db = _module("fill_db")
    bulk, reference = Database(db_url), Database(f"sqlite:///{tmp_path / 'reference.db'}")
    reference.upgrade()
    assert fill_db.fill(bulk, 60) == 60
    assert fill_db.fill(reference, 60, via_repository=True) == 60
    assert fill_db.fill(bulk, 60) == 0  # idempotent: nothing new
    got, want = _snapshot(bulk), _snapshot(reference)
    assert got == want
    assert {s[4]["method"] for s in got.values()} == {"baseline", "ring"}  # both kinds of winners
    # the ids the bulk path chose leave the tables usable by the repository afterwards
    fill_db.fill(bulk, 70)
    with bulk.session() as s:
        assert len(repo.list_winners(s)) == 70
    bulk.dispose()
    reference.dispose()


@pytest.mark.slow
def test_load_benchmark_runs(tmp_path):
    out = subprocess.run([sys.executable, str(BENCH / "load.py"), "--db", str(tmp_path / "bench.db"),
                          "--fill", "300", "--seconds", "0.5", "--workers", "1", "--concurrency", "4",
                          "--rate", "100", "--batch", "50", "--hot", "20", "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    phases = [r["phase"] for r in rows]
    assert phases[:6] == ["single, flat out", "single, 100/s offered", "single, hot set of 20, flat out",
                          "single, hot set, 100/s offered", "batch of 50",
                          "single untuned (nearest+demand)"], out.stdout
    assert phases[6].startswith("client cache hit")
    summary = out.stdout[out.stdout.index("| figure | target | sqlite |"):]  # issue 16's table
    assert "| single lookups/s, flat out | >= 4000 |" in summary
    assert "| batch of 50: p50 / p99 | <= 30 / 100 ms |" in summary and "| - |" not in summary
    assert all(r["errors"] == 0 and r["requests"] > 0 for r in rows), out.stdout

"""repository.get_winners: many problems' winners on one device in few queries."""

from __future__ import annotations

from db import repository as repo


def _seed(s, device_key: str, problem_key: str, ratio: float) -> None:
    dev = repo.upsert_device(s, key=device_key, platform="cpu", device_kind="cpu", num_devices=2,
                             num_processes=1, topology="inproc", jax_version="0", jaxlib_version="0")
    prob = repo.upsert_problem(s, key=problem_key, canonical={"k": problem_key}, equation="ab,bc->ac",
                               pattern="all_gather:lhs:free", dtype="float32", mesh_size=2,
                               m=8, n=8, k=8, b=1, flops=1024, comm_bytes=256)
    repo.record_measurements(s, dev.id, prob.id, [
        {"strategy": {"method": "baseline"}, "strategy_key": "baseline", "status": "ok", "median_s": 1.0,
         "ratio": 1.0, "ratio_lo": 1.0, "ratio_hi": 1.0, "samples": [1.0]},
        {"strategy": {"method": "ring"}, "strategy_key": "ring-x", "status": "ok", "median_s": 1.0 / ratio,
         "ratio": ratio, "ratio_lo": ratio - 0.05, "ratio_hi": ratio + 0.05, "samples": [1.0 / ratio]},
    ])
    repo.recompute_winner(s, dev.id, prob.id)


def test_get_winners_by_key(database):
    with database.session() as s:
        for i in range(7):
            _seed(s, "dev-a", f"p{i}", 1.1 + i / 10)
        _seed(s, "dev-b", "p0", 1.5)
    with database.session(read_only=True) as s:
        got = repo.get_winners(s, "dev-a", [f"p{i}" for i in range(7)] + ["missing", "p1"])
        assert set(got) == {f"p{i}" for i in range(7)}
        assert all(w.device_key == "dev-a" and w.problem_key == k for k, w in got.items())
        assert got["p3"].speedup == repo.get_winner(s, "dev-a", "p3").speedup
        assert repo.get_winners(s, "nope", ["p0"]) == {}
        assert repo.get_winners(s, "dev-a", []) == {}

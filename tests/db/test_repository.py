"""The repository contract, run against every backend (SQLite, PostgreSQL), plus the pure
winner rule, settings, and multi-process concurrency."""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import queue
import random
import threading
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import JSON, Double, Integer, event, func, insert, literal, select

from autotuner.settings import Settings, normalize_db_url
from db import (
    Database,
    DuplicateError,
    LeaseError,
    MeasurementRecord,
    NotFoundError,
    StorageError,
    WinnerChoice,
    choose_winner,
    session_scope,
)
from db import repository as repo
from db.records import DeviceRecord, ProblemRecord
from db.tables import Device, Problem, Token, UTCDateTime, Winner

BASELINE = {"method": "baseline"}
RING = {"method": "ring", "chunks": 2}
BIDI = {"method": "bidirectional", "chunks": 1}
PATTERN = "all_gather:lhs:free"
T0 = datetime(2026, 1, 1, tzinfo=UTC)


# --------------------------------------------------------------------------- helpers


def add_device(s: Any, key: str = "dev-a", **overrides: Any) -> DeviceRecord:
    fields: dict[str, Any] = {
        "key": key,
        "platform": "cpu",
        "device_kind": "cpu",
        "num_devices": 4,
        "num_processes": 4,
        "topology": "lab-ring-1gbit",
        "jax_version": "0.10.2",
        "jaxlib_version": "0.10.2",
    }
    fields.update(overrides)
    return repo.upsert_device(s, **fields)


def _beside(database: Database, first: Any, second: Any) -> tuple[Any, Any]:
    """(what `second` returned, what `first` returned): `first` runs in a transaction that stays
    open while `second` starts in another one (a thread); `first`'s then commits. Whatever must
    not happen twice across them has to wait for the first transaction or see what it wrote."""
    got: dict[str, Any] = {}

    def other() -> None:
        try:
            with database.session() as s:
                got["second"] = second(s)
        except Exception as exc:  # noqa: BLE001 - reported by the assert below
            got["error"] = exc

    with database.session() as s:
        got["first"] = first(s)
        t = threading.Thread(target=other)
        t.start()
        t.join(timeout=0.5)   # long enough for `second` to finish if nothing makes it wait
    t.join(timeout=60)
    assert not t.is_alive() and "error" not in got, got
    return got["second"], got["first"]


def add_problem(
    s: Any,
    key: str = "prob-a",
    *,
    m: float = 2048,
    n: float = 1024,
    k: float = 4096,
    b: float = 8,
    pattern: str = PATTERN,
    dtype: str = "bfloat16",
    mesh_size: int = 8,
) -> ProblemRecord:
    canonical = {
        "equation": "bsd,df->bsf",
        "lhs": {"shape": [b, m, k], "spec": [None, "x", None]},
        "rhs": {"shape": [k, n], "spec": [None, "x"]},
        "out_spec": [None, None, "x"],
        "dtype": dtype,
        "mesh": {"x": mesh_size},
    }
    return repo.upsert_problem(
        s,
        key=key,
        canonical=canonical,
        equation="bsd,df->bsf",
        pattern=pattern,
        dtype=dtype,
        mesh_size=mesh_size,
        m=m,
        n=n,
        k=k,
        b=b,
        flops=2.0 * b * m * n * k,
        comm_bytes=2.0 * b * m * k,
    )


def item(
    strategy: dict[str, Any],
    *,
    median: float = 0.010,
    ratio: float | None = None,
    lo: float | None = None,
    hi: float | None = None,
    status: str = "ok",
    **extra: Any,
) -> dict[str, Any]:
    key = ",".join(f"{k}={v}" for k, v in sorted(strategy.items()))
    out: dict[str, Any] = {"strategy": strategy, "strategy_key": key, "status": status}
    if status == "ok":
        out.update(
            samples=[median * 0.99, median, median * 1.01],
            median_s=median,
            iqr_s=median * 0.02,
            min_s=median * 0.99,
            ratio=ratio,
            ratio_lo=lo,
            ratio_hi=hi,
        )
    else:
        out["reason"] = extra.pop("reason", "out of memory")
    out.update(extra)
    return out


def mrec(
    id: int,
    strategy: dict[str, Any],
    *,
    status: str = "ok",
    ratio: float | None = None,
    lo: float | None = None,
    hi: float | None = None,
    median: float | None = 0.01,
    at: datetime | None = None,
    traffic: float | None = None,
    aa: float | None = None,
    source: str | None = "tuned",
    n: int = 0,
) -> MeasurementRecord:
    """A measurement record for the pure rule tests."""
    return MeasurementRecord(
        id=id,
        problem_id=1,
        device_id=1,
        strategy=strategy,
        strategy_key=",".join(f"{k}={v}" for k, v in sorted(strategy.items())),
        method=strategy["method"],
        status=status,
        reason=None if status == "ok" else "boom",
        samples=(),
        median_s=median if status == "ok" else None,
        iqr_s=None,
        min_s=None,
        n=n,
        ratio=ratio,
        ratio_lo=lo,
        ratio_hi=hi,
        aa_width=aa,
        compile_s=None,
        memory=None,
        run_id=None,
        host=None,
        serial_s=None if traffic is None else 0.01 * ratio / traffic if ratio else None,
        traffic_speedup=traffic,
        source=source,
        token_id=None,
        created_at=at or T0 + timedelta(seconds=id),
    )


# --------------------------------------------------------------------------- contract


class TestRepositoryContract:
    """Every backend keeps this contract (see db.repository's docstring)."""

    def test_upsert_device_is_idempotent(self, database: Database) -> None:
        with database.session() as s:
            a = add_device(s)
            again = add_device(s, platform="ignored-existing-key-wins")
            other = add_device(s, key="dev-b")
        assert again == a
        assert other.id != a.id
        assert (a.key, a.platform, a.num_devices, a.topology) == (
            "dev-a",
            "cpu",
            4,
            "lab-ring-1gbit",
        )
        assert a.created_at.tzinfo is not None and a.created_at.utcoffset() == timedelta(0)
        with pytest.raises(dataclasses.FrozenInstanceError):
            a.key = "x"  # type: ignore[misc]
        with database.session() as s:
            assert repo.get_device_by_key(s, "dev-a") == a
            assert repo.get_device(s, a.id) == a
            assert repo.get_device_by_key(s, "nope") is None
            assert [d.key for d in repo.list_devices(s)] == ["dev-a", "dev-b"]

    def test_upsert_problem_is_idempotent(self, database: Database) -> None:
        with database.session() as s:
            p = add_problem(s)
            assert add_problem(s) == p
            q = add_problem(s, "prob-b", m=4096)
        assert q.id != p.id
        assert p.canonical["mesh"] == {"x": 8}
        assert (p.pattern, p.dtype, p.mesh_size, p.m, p.n, p.k, p.b) == (
            PATTERN,
            "bfloat16",
            8,
            2048,
            1024,
            4096,
            8,
        )
        with database.session() as s:
            assert repo.get_problem(s, p.id) == p
            assert repo.get_problem_by_key(s, "prob-b") == q
            assert repo.get_problem(s, 10_000) is None

    def test_records_are_copies(self, database: Database) -> None:
        with database.session() as s:
            p = add_problem(s)
        p.canonical["mesh"]["x"] = 999  # mutating the record's dict never touches the database
        with database.session() as s:
            assert repo.get_problem(s, p.id).canonical["mesh"] == {"x": 8}  # type: ignore[union-attr]

    @pytest.mark.parametrize(
        ("field", "value"),
        [
            ("m", -1.0),
            ("n", math.nan),
            ("k", math.inf),
            ("mesh_size", 0),
            ("key", ""),
            ("canonical", [1]),
        ],
    )
    def test_upsert_problem_validates(self, database: Database, field: str, value: Any) -> None:
        kwargs: dict[str, Any] = {
            "key": "p",
            "canonical": {},
            "equation": "ij,jk->ik",
            "pattern": PATTERN,
            "dtype": "float32",
            "mesh_size": 2,
            "m": 1.0,
            "n": 1.0,
            "k": 1.0,
            "b": 1.0,
            "flops": 1.0,
            "comm_bytes": 1.0,
        }
        kwargs[field] = value
        with pytest.raises(ValueError, match=field), database.session() as s:
            repo.upsert_problem(s, **kwargs)

    def test_record_and_list_measurements(self, database: Database) -> None:
        with database.session() as s:
            d = add_device(s)
            d2 = add_device(s, key="dev-b")
            p = add_problem(s)
            stored = repo.record_measurements(
                s,
                d.id,
                p.id,
                [
                    item(
                        BASELINE,
                        median=0.02,
                        compile_s=1.5,
                        memory={"peak_bytes": 123},
                        run_id="r1",
                        host="h",
                    ),
                    item(RING, median=0.015, ratio=1.33, lo=1.2, hi=1.4),
                    item(BIDI, status="failed", reason="lowering failed"),
                ],
            )
            repo.record_measurements(s, d2.id, p.id, [item(BASELINE)])
            assert repo.record_measurements(s, d.id, p.id, []) == []
        assert [m.method for m in stored] == ["baseline", "ring", "bidirectional"]
        base, ring, bidi = stored
        assert base.samples == (0.02 * 0.99, 0.02, 0.02 * 1.01) and base.n == 3
        assert (base.compile_s, base.memory, base.run_id, base.host) == (
            1.5,
            {"peak_bytes": 123},
            "r1",
            "h",
        )
        assert base.ratio is None and ring.ratio == pytest.approx(1.33)
        assert (bidi.status, bidi.reason, bidi.median_s) == ("failed", "lowering failed", None)
        assert base.created_at.utcoffset() == timedelta(0)
        with database.session() as s:
            assert repo.list_measurements(s, p.id, d.id) == stored
            assert len(repo.list_measurements(s, p.id)) == 4
            assert repo.list_measurements(s, p.id, 10_000) == []

    def test_record_measurements_validates_all_before_writing(self, database: Database) -> None:
        with database.session() as s:
            d, p = add_device(s), add_problem(s)
        bad_items: list[Any] = [
            {"strategy": BASELINE, "strategy_key": "b", "status": "ok"},  # ok without median_s
            {"strategy": {}, "strategy_key": "b", "status": "failed"},  # no method
            {"strategy": BASELINE, "strategy_key": "b", "status": "maybe"},
            {**item(BASELINE), "typo_field": 1},
            {**item(BASELINE), "samples": [0.1, math.nan]},
        ]
        for bad in bad_items:
            with pytest.raises(ValueError), database.session() as s:
                repo.record_measurements(s, d.id, p.id, [item(RING, ratio=2, lo=2, hi=2), bad])
        with database.session() as s:
            assert repo.list_measurements(s, p.id) == []
            with pytest.raises(NotFoundError):
                repo.record_measurements(s, 10_000, p.id, [item(BASELINE)])
            with pytest.raises(NotFoundError):
                repo.record_measurements(s, d.id, 10_000, [item(BASELINE)])

    def _winner_after(self, database: Database, items: list[dict[str, Any]]) -> Any:
        with database.session() as s:
            d, p = add_device(s), add_problem(s)
            repo.record_measurements(s, d.id, p.id, items)
            return repo.recompute_winner(s, d.id, p.id)

    def test_winner_baseline_kept_when_ci_includes_one(self, database: Database) -> None:
        w = self._winner_after(
            database,
            [item(BASELINE, median=0.020), item(RING, median=0.018, ratio=1.11, lo=0.97, hi=1.25)],
        )
        assert w.strategy == BASELINE and w.method == "baseline"
        assert (w.speedup, w.speedup_lo, w.speedup_hi) == (1.0, None, None)
        assert w.baseline_s == w.winner_s == pytest.approx(0.020)

    def test_winner_candidate_wins_when_ci_above_one(self, database: Database) -> None:
        w = self._winner_after(
            database,
            [
                item(BASELINE, median=0.020),
                item(RING, median=0.016, ratio=1.25, lo=1.10, hi=1.40),
                item(BIDI, median=0.015, ratio=1.33, lo=1.01, hi=1.60),
            ],
        )
        assert w.strategy == BIDI and w.strategy_key == "chunks=1,method=bidirectional"
        assert (w.speedup, w.speedup_lo, w.speedup_hi) == (1.33, 1.01, 1.60)
        assert w.winner_s == 0.015 and w.baseline_s == pytest.approx(1.33 * 0.015)   # its own session's
        assert w.trials == 3 and len(w.measurement_ids) == 3
        assert (w.device_key, w.problem_key) == ("dev-a", "prob-a")

    def test_winner_uses_latest_measurement_of_a_strategy(self, database: Database) -> None:
        with database.session() as s:
            d, p = add_device(s), add_problem(s)
            repo.record_measurements(
                s, d.id, p.id, [item(BASELINE), item(RING, ratio=1.5, lo=1.3, hi=1.7)]
            )
            assert repo.recompute_winner(s, d.id, p.id).strategy == RING  # type: ignore[union-attr]
            # re-measured: the gain was noise
            later = repo.record_measurements(
                s, d.id, p.id, [item(RING, ratio=1.02, lo=0.9, hi=1.1)]
            )
            w = repo.recompute_winner(s, d.id, p.id)
            assert w is not None and w.strategy == BASELINE and later[0].id in w.measurement_ids
            # re-measured again, now it fails: still baseline
            repo.record_measurements(s, d.id, p.id, [item(RING, status="failed")])
            assert repo.recompute_winner(s, d.id, p.id).strategy == BASELINE  # type: ignore[union-attr]
            assert repo.recompute_winner(s, d.id, p.id).trials == 4  # type: ignore[union-attr]

    def test_recompute_keeps_one_row_and_updates_it(self, database: Database) -> None:
        with database.session() as s:
            d, p = add_device(s), add_problem(s)
            repo.record_measurements(s, d.id, p.id, [item(BASELINE)])
            first = repo.recompute_winner(s, d.id, p.id)
        with database.session() as s:
            repo.record_measurements(s, d.id, p.id, [item(RING, ratio=1.4, lo=1.2, hi=1.6)])
            second = repo.recompute_winner(s, d.id, p.id)
            assert s.scalar(select(func.count()).select_from(Winner)) == 1
        assert first is not None and second is not None
        assert second.id == first.id and second.created_at == first.created_at
        assert second.updated_at >= first.updated_at and second.strategy == RING
        with database.session() as s:
            assert repo.get_winner(s, "dev-a", "prob-a") == second
            assert repo.get_winner(s, "dev-b", "prob-a") is None
            assert repo.list_winners(s, "dev-a") == [second]

    def test_no_winner_without_successful_measurements(self, database: Database) -> None:
        with database.session() as s:
            d, p = add_device(s), add_problem(s)
            assert repo.recompute_winner(s, d.id, p.id) is None
            repo.record_measurements(s, d.id, p.id, [item(BASELINE)])
            assert repo.recompute_winner(s, d.id, p.id) is not None
            repo.record_measurements(s, d.id, p.id, [item(BASELINE, status="failed")])
            assert repo.recompute_winner(s, d.id, p.id) is None  # stale winner removed
            assert repo.get_winner(s, "dev-a", "prob-a") is None
            with pytest.raises(NotFoundError):
                repo.recompute_winner(s, d.id, 10_000)
            with pytest.raises(NotFoundError):
                repo.recompute_winner(s, 10_000, p.id)

    def test_a_tpu_devices_reference_is_plain(self, database: Database) -> None:
        plain = {"method": "plain"}
        with database.session() as s:
            tpu, cpu, p = add_device(s, "dev-tpu", platform="tpu"), add_device(s, "dev-cpu"), add_problem(s)
            ms = [item(plain, ratio=1.0, lo=1.0, hi=1.0), item(BASELINE, ratio=0.8, lo=0.8, hi=0.8),
                  item(RING, ratio=0.9, lo=0.9, hi=0.9)]
            repo.record_measurements(s, tpu.id, p.id, ms)
            repo.record_measurements(s, cpu.id, p.id, [item(BASELINE), item(plain, ratio=1.3, lo=1.1, hi=1.5),
                                                       item(RING, ratio=1.25, lo=1.2, hi=1.3)])
            on_tpu, on_cpu = repo.recompute_winner(s, tpu.id, p.id), repo.recompute_winner(s, cpu.id, p.id)
        assert on_tpu is not None and on_tpu.strategy == plain and on_tpu.speedup == 1.0   # nothing beats plain
        # elsewhere the baseline is the reference; the ring clears 1 but not plain's 1.3: plain wins
        assert on_cpu is not None and on_cpu.strategy == plain and on_cpu.speedup == 1.3

    def test_recompute_accepts_another_rule(self, database: Database) -> None:
        def fastest(ms: Any, reference: str) -> WinnerChoice:
            best = min((m for m in ms if m.status == "ok"), key=lambda m: m.median_s)
            return WinnerChoice(
                strategy=best.strategy,
                strategy_key=best.strategy_key,
                method=best.method,
                speedup=9.0,
                speedup_lo=None,
                speedup_hi=None,
                baseline_s=None,
                winner_s=best.median_s,
                measurement_id=best.id,
                measurement_ids=(best.id,),
                trials=len(ms),
            )

        with database.session() as s:
            d, p = add_device(s), add_problem(s)
            repo.record_measurements(
                s, d.id, p.id, [item(BASELINE, median=2.0), item(RING, median=1.0)]
            )
            w = repo.recompute_winner(s, d.id, p.id, fastest)
        assert w is not None and (w.strategy, w.speedup, w.winner_s) == (RING, 9.0, 1.0)

    def test_nearest_orders_by_log_shape_distance_and_filters(self, database: Database) -> None:
        with database.session() as s:
            d, other = add_device(s), add_device(s, key="dev-b")
            shapes = {"p1024": 1024, "p2048": 2048, "p8192": 8192, "p512": 512}
            for key, m in shapes.items():
                p = add_problem(s, key, m=m)
                repo.record_measurements(s, d.id, p.id, [item(BASELINE)])
                repo.recompute_winner(s, d.id, p.id)
            decoys = [
                add_problem(s, "other-pattern", m=2048, pattern="reduce_scatter:out:free"),
                add_problem(s, "other-dtype", m=2048, dtype="float32"),
                add_problem(s, "other-mesh", m=2048, mesh_size=4),
            ]
            for p in decoys:
                repo.record_measurements(s, d.id, p.id, [item(BASELINE)])
                repo.recompute_winner(s, d.id, p.id)
            p = add_problem(s, "other-device", m=2048)
            repo.record_measurements(s, other.id, p.id, [item(BASELINE)])
            repo.recompute_winner(s, other.id, p.id)
            add_problem(s, "untuned", m=2048)

        query = {
            "pattern": PATTERN,
            "dtype": "bfloat16",
            "mesh_size": 8,
            "n": 1024,
            "k": 4096,
            "b": 8,
        }
        with database.session(read_only=True) as s:
            near = repo.nearest_winners(s, "dev-a", m=1800, **query)
            assert [nb.problem.key for nb in near] == ["p2048", "p1024", "p512", "p8192"]
            assert near[0].distance == pytest.approx(abs(math.log2(1800) - 11))
            winner, problem, distance = near[1]
            assert winner.problem_id == problem.id and winner.device_key == "dev-a"
            assert distance == pytest.approx(math.log2(1800) - 10)
            assert [
                nb.problem.key for nb in repo.nearest_winners(s, "dev-a", m=1800, limit=2, **query)
            ] == [
                "p2048",
                "p1024",
            ]
            excluded = repo.nearest_winners(s, "dev-a", m=2048, exclude_key="p2048", **query)
            assert excluded[0].problem.key == "p1024"
            assert [nb.problem.key for nb in repo.nearest_winners(s, "dev-b", m=1, **query)] == [
                "other-device"
            ]
            assert repo.nearest_winners(s, "dev-x", m=1, **query) == []
            # a problem's extent k changes the distance too
            far_k = repo.nearest_winners(s, "dev-a", m=2048, **{**query, "k": 4096 * 16})
            assert far_k[0].problem.key == "p2048" and far_k[0].distance == pytest.approx(4.0)
            # max_distance: a ball, not only the box it prefilters with
            within = repo.nearest_winners(s, "dev-a", m=1800, max_distance=2.0, **query)
            assert [nb.problem.key for nb in within] == ["p2048", "p1024", "p512"]
            assert repo.nearest_winners(s, "dev-a", m=2048, max_distance=3.9,
                                        **{**query, "k": 4096 * 16}) == []
            box_corner = repo.nearest_winners(s, "dev-a", m=1800 * 2 ** 1.5, max_distance=2.0,
                                              **{**query, "k": 4096 * 2 ** 1.5})
            assert all(nb.distance <= 2.0 for nb in box_corner)

    def test_list_problems_pages_sorts_and_filters(self, database: Database) -> None:
        with database.session() as s:
            d, d2 = add_device(s), add_device(s, key="dev-b")
            ratios = [1.1, 1.5, 1.3, 1.05, 1.7]
            for i, r in enumerate(ratios):
                p = add_problem(
                    s, f"p{i}", m=1024 * (i + 1), dtype="float32" if i == 4 else "bfloat16"
                )
                repo.record_measurements(
                    s, d.id, p.id, [item(BASELINE), item(RING, ratio=r, lo=r - 0.09, hi=r + 0.1)]
                )
                repo.recompute_winner(s, d.id, p.id)
            p0 = repo.get_problem_by_key(s, "p0")
            assert p0 is not None
            repo.record_measurements(s, d2.id, p0.id, [item(BASELINE)])
            repo.recompute_winner(s, d2.id, p0.id)
            add_problem(s, "untuned")

        with database.session(read_only=True) as s:
            page = repo.list_problems(s, sort="speedup", desc=True, limit=2)
            assert page.total == 6 and page.has_more
            assert [(r.problem.key, r.device.key) for r in page.items] == [
                ("p4", "dev-a"),
                ("p1", "dev-a"),
            ]  # type: ignore[union-attr]
            page2 = repo.list_problems(s, sort="speedup", desc=True, offset=2, limit=2)
            assert [r.problem.key for r in page2.items] == ["p2", "p0"]
            last = repo.list_problems(s, sort="speedup", desc=True, offset=4, limit=2)
            # speedup ties (p3 on dev-a and p0 on dev-b keep the baseline): higher problem id first
            assert [(r.problem.key, r.device.key) for r in last.items] == [  # type: ignore[union-attr]
                ("p3", "dev-a"),
                ("p0", "dev-b"),
            ]
            assert not last.has_more
            asc = repo.list_problems(s, device_key="dev-a", sort="speedup", desc=False)
            assert [r.problem.key for r in asc.items] == ["p3", "p0", "p2", "p1", "p4"]
            assert all(r.winner is not None and r.winner.device_key == "dev-a" for r in asc.items)

            # baseline kept: p3 on dev-a (1.05 - 0.09 < 1), p0 on dev-b (no candidate)
            assert repo.list_problems(s, method="baseline").total == 2
            assert (
                repo.list_problems(s, method="ring", device_key="dev-a").total == 4
            )  # p3: 1.05-0.09 < 1
            assert [r.problem.key for r in repo.list_problems(s, dtype="float32").items] == ["p4"]
            assert repo.list_problems(s, pattern="reduce_scatter:out:free").total == 0
            assert repo.list_problems(s, device_key="dev-x").total == 0
            assert [r.problem.key for r in repo.list_problems(s, search="p3").items] == ["p3"]
            assert repo.list_problems(s, search="bsd,df").total == 6

            everything = repo.list_problems(s, tuned_only=False, sort="key", desc=False, limit=100)
            assert everything.total == 7
            assert (
                everything.items[-1].problem.key == "untuned"
                and everything.items[-1].winner is None
            )
            per_device = repo.list_problems(
                s, device_key="dev-b", tuned_only=False, sort="created", desc=False
            )
            assert per_device.total == 6
            assert [r.winner is not None for r in per_device.items] == [True] + [False] * 5
            by_flops = repo.list_problems(s, device_key="dev-a", sort="flops")
            assert [r.problem.key for r in by_flops.items] == ["p4", "p3", "p2", "p1", "p0"]
            for sort in repo.SORT_KEYS:
                assert repo.list_problems(s, sort=sort).total == 6
            with pytest.raises(ValueError, match="sort"):
                repo.list_problems(s, sort="nonsense")
            with pytest.raises(ValueError, match="limit"):
                repo.list_problems(s, limit=0)

    def test_jobs_claim_lease_expiry_and_reclaim(self, database: Database) -> None:
        dev = {"platform": "cpu"}
        with database.session() as s:
            low = repo.enqueue_job(
                s, problem_key="p1", problem={"k": 1}, device_key="d", device=dev, now=T0
            )
            high = repo.enqueue_job(
                s,
                problem_key="p2",
                problem={"k": 2},
                device_key="d",
                device=dev,
                priority=5,
                now=T0,
            )
            later = repo.enqueue_job(
                s,
                problem_key="p3",
                problem={"k": 3},
                device_key="d",
                device=dev,
                params={"trials": 9},
                now=T0 + timedelta(seconds=1),
            )
            elsewhere = repo.enqueue_job(
                s, problem_key="p1", problem={"k": 1}, device_key="e", device=dev, now=T0
            )
            # one active job per (device, problem): enqueueing again returns it
            assert (
                repo.enqueue_job(s, problem_key="p1", problem={"k": 1}, device_key="d", device=dev)
                == low
            )
        assert (low.status, low.attempts, low.worker, later.params) == (
            "queued",
            0,
            None,
            {"trials": 9},
        )

        with database.session() as s:
            a = repo.claim_job(s, "w-a", 60, now=T0, device_key="d")
            b = repo.claim_job(s, "w-b", 60, now=T0, device_key="d")
            c = repo.claim_job(s, "w-c", 60, now=T0, device_key="d")
            assert repo.claim_job(s, "w-d", 60, now=T0, device_key="d") is None
        assert [j.id for j in (a, b, c)] == [high.id, low.id, later.id]  # type: ignore[union-attr]
        assert a is not None and (a.status, a.worker, a.attempts) == ("running", "w-a", 1)
        assert a.lease_expires_at == T0 + timedelta(seconds=60)

        with database.session() as s:
            hb = repo.heartbeat_job(s, a.id, "w-a", 60, now=T0 + timedelta(seconds=50))
            assert hb.lease_expires_at == T0 + timedelta(seconds=110)
            # b's lease (T0+60) expired at T0+100; a's did not
            again = repo.claim_job(s, "w-e", 60, now=T0 + timedelta(seconds=100), device_key="d")
            assert (
                again is not None
                and again.id == low.id
                and (again.worker, again.attempts) == ("w-e", 2)
            )
            with pytest.raises(LeaseError):
                repo.heartbeat_job(s, low.id, "w-b", 60, now=T0 + timedelta(seconds=101))
            with pytest.raises(LeaseError):
                repo.finish_job(s, low.id, "w-b", "done")
            done = repo.finish_job(s, low.id, "w-e", "done", now=T0 + timedelta(seconds=120))
            assert (done.status, done.lease_expires_at) == ("done", None)
            with pytest.raises(LeaseError):
                repo.finish_job(s, low.id, "w-e", "done")
            failed = repo.finish_job(s, a.id, "w-a", "failed", error="compile error")
            assert (failed.status, failed.error) == ("failed", "compile error")
            with pytest.raises(NotFoundError):
                repo.heartbeat_job(s, 10_000, "w-a", 60)
            with pytest.raises(ValueError, match="status"):
                repo.finish_job(s, c.id, "w-c", "queued")  # type: ignore[union-attr]
            # finished jobs are never claimed again, even long after
            assert (
                repo.claim_job(
                    s, "w-f", 60, now=T0 + timedelta(days=1), device_key="d", max_attempts=1
                )
                is None
            )
            late = repo.claim_job(s, "w-f", 60, now=T0 + timedelta(days=1), device_key="d")
            assert late is not None and late.id == later.id and late.attempts == 2
            # a finished pair can be queued again
            requeued = repo.enqueue_job(
                s, problem_key="p1", problem={"k": 1}, device_key="d", device=dev
            )
            assert requeued.id != low.id and requeued.status == "queued"
            other = repo.claim_job(s, "w-g", 60, now=T0, device_key="e")
            assert other is not None and other.id == elsewhere.id

        with database.session(read_only=True) as s:
            assert repo.get_job(s, low.id) == done
            assert repo.get_job(s, 10_000) is None
            all_jobs = repo.list_jobs(s)
            assert all_jobs.total == 5 and all_jobs.items[0].id == requeued.id
            assert {j.id for j in repo.list_jobs(s, status="running").items} == {
                later.id,
                elsewhere.id,
            }
            assert repo.list_jobs(s, device_key="e").total == 1
            assert len(repo.list_jobs(s, limit=2).items) == 2

    def test_release_hands_a_held_job_back_uncounted(self, database: Database) -> None:
        dev = {"platform": "cpu"}
        with database.session() as s:
            job = repo.enqueue_job(s, problem_key="p", problem={}, device_key="d", device=dev, now=T0)
            claimed = repo.claim_job(s, "w-a", 600, now=T0)
            assert claimed is not None and claimed.attempts == 1
            with pytest.raises(LeaseError):
                repo.release_job(s, job.id, "w-b")
            with pytest.raises(NotFoundError):
                repo.release_job(s, 10_000, "w-a")
            back = repo.release_job(s, job.id, "w-a", now=T0 + timedelta(seconds=5))
            assert (back.status, back.worker, back.lease_expires_at, back.attempts) == ("queued", None, None, 0)
            assert back.updated_at == T0 + timedelta(seconds=5)
            with pytest.raises(LeaseError):   # released: no longer held, so not twice
                repo.release_job(s, job.id, "w-a")
            # claimable at once (the lease of 600 s has not run out), and by max_attempts=1
            again = repo.claim_job(s, "w-b", 60, now=T0 + timedelta(seconds=6), max_attempts=1)
            assert again is not None and again.id == job.id and again.attempts == 1
            done = repo.finish_job(s, job.id, "w-b", "done")
            with pytest.raises(LeaseError):   # a finished job stays finished
                repo.release_job(s, done.id, "w-b")

    def test_a_job_its_workers_died_on_is_failed_after_its_last_claim(self, database: Database) -> None:
        with database.session() as s:
            job = repo.enqueue_job(s, problem_key="p", problem={}, device_key="d", device={}, now=T0)
            other = repo.enqueue_job(s, problem_key="p", problem={}, device_key="e", device={}, now=T0)
            # both claimed by workers that die: no heartbeat, no finish
            assert repo.claim_job(s, "w-a", 60, now=T0, device_key="d")
            assert repo.claim_job(s, "w-b", 60, now=T0, device_key="e")
            assert repo.fail_abandoned(s, 2, now=T0 + timedelta(seconds=100)) == []   # one claim each so far
            again = repo.claim_job(s, "w-c", 60, now=T0 + timedelta(seconds=100), device_key="d", max_attempts=2)
            assert again is not None and (again.id, again.attempts) == (job.id, 2)
            assert repo.fail_abandoned(s, 2, now=T0 + timedelta(seconds=150)) == []   # its lease holds
            gone = repo.fail_abandoned(s, 2, now=T0 + timedelta(seconds=200), device_key="d")
            assert [(j.id, j.status, j.lease_expires_at) for j in gone] == [(job.id, "failed", None)]
            assert gone[0].error is not None and gone[0].error.startswith(
                "abandoned: claimed 2 times, and each worker's lease ran out before it finished")
            assert repo.claim_job(s, "w-d", 60, now=T0 + timedelta(seconds=200), device_key="d", max_attempts=2) is None
            # the other device's job was not asked about; a handed-back claim is not counted
            assert repo.get_job(s, other.id).status == "running"  # type: ignore[union-attr]
            repo.release_job(s, other.id, "w-b", now=T0 + timedelta(seconds=10))
            assert repo.fail_abandoned(s, 1, now=T0 + timedelta(days=1)) == []
            with pytest.raises(ValueError, match="max_attempts"):
                repo.fail_abandoned(s, 0)

    def test_a_cancelled_job_fails_and_its_worker_loses_it(self, database: Database) -> None:
        with database.session() as s:
            queued = repo.enqueue_job(s, problem_key="p", problem={}, device_key="d", device={}, now=T0)
            running = repo.enqueue_job(s, problem_key="q", problem={}, device_key="d", device={}, now=T0)
            assert repo.claim_job(s, "w", 60, now=T0, device_key="d") is not None   # the oldest: p
            assert repo.claim_job(s, "w", 60, now=T0, device_key="d") is not None   # then q
            gone = repo.cancel_job(s, running.id, "wrong mesh", now=T0 + timedelta(seconds=1))
            assert (gone.status, gone.error, gone.lease_expires_at) == ("failed", "cancelled: wrong mesh", None)
            with pytest.raises(LeaseError):
                repo.heartbeat_job(s, running.id, "w", 60)
            assert repo.cancel_job(s, queued.id).error == "cancelled"
            assert repo.cancel_job(s, queued.id, "again") == repo.get_job(s, queued.id)   # finished: as it is
            done = repo.enqueue_job(s, problem_key="r", problem={}, device_key="d", device={}, now=T0)
            assert repo.claim_job(s, "w", 60, now=T0, device_key="d") is not None
            finished = repo.finish_job(s, done.id, "w", "done")
            assert repo.cancel_job(s, done.id) == finished
            with pytest.raises(NotFoundError):
                repo.cancel_job(s, 10_000)

    def test_a_finished_job_is_queued_again_as_a_new_one(self, database: Database) -> None:
        with database.session() as s:
            job = repo.enqueue_job(s, problem_key="p", problem={"k": 1}, device_key="d", device={"x": 1},
                                   params={"trials": 3}, priority=2, now=T0)
            assert repo.retry_job(s, job.id) == job   # still queued: that one
            assert repo.claim_job(s, "w", 60, now=T0) is not None
            repo.finish_job(s, job.id, "w", "failed", error="boom")
            again = repo.retry_job(s, job.id, now=T0 + timedelta(seconds=1))
            assert again.id != job.id and (again.status, again.attempts, again.params, again.priority,
                                           again.problem, again.device) == (
                "queued", 0, {"trials": 3}, 2, {"k": 1}, {"x": 1})
            assert repo.get_job(s, job.id).error == "boom"  # type: ignore[union-attr]
            with pytest.raises(NotFoundError):
                repo.retry_job(s, 10_000)

    def test_demand_becomes_jobs_once(self, database: Database) -> None:
        with database.session() as s:
            for key, n in (("p1", 5), ("p2", 3), ("p3", 1), ("p4", 9), ("p5", 2)):
                for i in range(n):
                    repo.record_miss(s, "d", {"platform": "cpu"}, key, {"k": key}, now=T0 + timedelta(seconds=i))
            repo.record_miss(s, "e", {"platform": "gpu"}, "p1", {"k": "p1"}, now=T0)
            dev, tuned = add_device(s, "d"), add_problem(s, "p2")    # p2 has a winner by now: not queued
            repo.record_measurements(s, dev.id, tuned.id, [
                {"strategy": {"method": "baseline"}, "strategy_key": "baseline", "status": "ok", "median_s": 1.0,
                 "samples": [1.0]}])
            repo.recompute_winner(s, dev.id, tuned.id)
            failed = repo.enqueue_job(s, problem_key="p4", problem={}, device_key="d", device={})
            assert repo.claim_job(s, "w", 60) is not None
            repo.finish_job(s, failed.id, "w", "failed", error="boom")   # p4's job failed: not again

            first = repo.enqueue_demand(s, "d", limit=2, params={"trials": 3}, now=T0)
            assert [(j.problem_key, j.problem, j.device, j.status, j.params) for j in first] == [
                ("p1", {"k": "p1"}, {"platform": "cpu"}, "queued", {"trials": 3}),
                ("p5", {"k": "p5"}, {"platform": "cpu"}, "queued", {"trials": 3})]
            assert repo.enqueue_demand(s, "d", min_count=2) == []          # p3 was missed once
            third = repo.enqueue_demand(s, "d")
            assert [j.problem_key for j in third] == ["p3"]
            assert repo.enqueue_demand(s, "d") == []                       # each pair once
            assert [j.device for j in repo.enqueue_demand(s, "e")] == [{"platform": "gpu"}]
            for bad in (0, 1001, True, "3"):
                with pytest.raises(ValueError, match="limit"):
                    repo.enqueue_demand(s, "d", limit=bad)  # type: ignore[arg-type]
            with pytest.raises(ValueError, match="min_count"):
                repo.enqueue_demand(s, "d", min_count=0)

    def test_demand_queued_from_two_places_at_once_is_queued_once(self, database: Database) -> None:
        """Two idle workers ask for demand at the same moment (a worker pool's replicas): each pair
        is queued by one of them. The second transaction starts while the first, which queued
        both pairs, is still open (on PostgreSQL it read no job before the fix, and the table's one
        active job per pair handed it the first's two jobs as its own: it said it had queued them,
        and never went on to the next pairs)."""
        with database.session() as s:
            for key in ("p1", "p2"):
                repo.record_miss(s, "d", {"platform": "cpu"}, key, {"k": key}, now=T0)
        second = _beside(database, lambda s: [j.problem_key for j in repo.enqueue_demand(s, "d")],
                         lambda s: [j.problem_key for j in repo.enqueue_demand(s, "d")])
        assert second == ([], ["p1", "p2"])
        with database.session(read_only=True) as s:
            assert sorted(j.problem_key for j in repo.list_jobs(s).items) == ["p1", "p2"]

    def test_an_upload_replayed_while_the_first_is_stored_is_stored_once(self, database: Database) -> None:
        """A worker's request timed out while the service was still storing it, and the worker sent
        it again: the replay's transaction starts before the first one commits."""
        with database.session() as s:
            dev, prob = add_device(s, "d"), add_problem(s, "p")
        items = [{"strategy": {"method": "baseline"}, "strategy_key": "baseline", "status": "ok",
                  "median_s": 1.0, "samples": [1.0, 1.1], "run_id": "r1"}]

        def store(s: Any) -> int:
            stored = repo.record_measurements(s, dev.id, prob.id, items)
            repo.recompute_winner(s, dev.id, prob.id)
            return len(stored)

        assert _beside(database, store, store) == (0, 1)
        with database.session(read_only=True) as s:
            assert len(repo.list_measurements(s, prob.id, dev.id)) == 1

    def test_demand_counts_misses(self, database: Database) -> None:
        with database.session() as s:
            first = repo.record_miss(
                s, "d", {"platform": "cpu"}, "p1", {"equation": "ij,jk->ik"}, now=T0
            )
            for i in range(3):
                repo.record_miss(
                    s, "d", {"platform": "cpu"}, "p2", {}, now=T0 + timedelta(seconds=i)
                )
            latest = repo.record_miss(
                s, "d", {"platform": "cpu"}, "p1", {}, now=T0 + timedelta(seconds=9)
            )
            repo.record_miss(s, "e", {}, "p1", {}, now=T0)
        assert first.count == 1 and latest.count == 2 and latest.id == first.id
        assert latest.first_seen == T0 and latest.last_seen == T0 + timedelta(seconds=9)
        assert latest.problem == {"equation": "ij,jk->ik"}  # the first canonical is kept
        with database.session() as s:
            ranked = repo.list_demand(s, 10)
            assert [(r.problem_key, r.device_key, r.count) for r in ranked] == [
                ("p2", "d", 3),
                ("p1", "d", 2),
                ("p1", "e", 1),
            ]
            assert len(repo.list_demand(s, 1)) == 1
            assert [r.device_key for r in repo.list_demand(s, 10, device_key="e")] == ["e"]
            # once tuned, a pair drops out of the untuned demand
            dev, prob = add_device(s, key="d"), add_problem(s, key="p2")
            repo.record_measurements(s, dev.id, prob.id, [item(BASELINE)])
            repo.recompute_winner(s, dev.id, prob.id)
            assert [r.problem_key for r in repo.list_demand(s, 10, untuned_only=True)] == [
                "p1",
                "p1",
            ]

    def test_tokens(self, database: Database) -> None:
        with database.session() as s:
            w = repo.add_token(s, "ci", "s3cret-write-token", "write")
            repo.add_token(s, "dash", "s3cret-read-token", "read")
            stored = s.scalars(select(Token.token_hash)).all()
        assert w.scope == "write" and w.revoked_at is None
        assert (
            "s3cret-write-token" not in stored and repo.token_hash("s3cret-write-token") in stored
        )
        with database.session() as s:
            assert repo.check_token(s, "s3cret-write-token") == "write"
            assert repo.check_token(s, "s3cret-read-token") == "read"
            assert repo.check_token(s, "s3cret-write-token ") is None
            assert repo.check_token(s, "") is None
            with pytest.raises(DuplicateError):
                repo.add_token(s, "again", "s3cret-write-token", "read")
            with pytest.raises(ValueError, match="scope"):
                repo.add_token(s, "x", "other", "admin")
        with database.session() as s:
            revoked = repo.revoke_token(s, w.id)
            assert revoked.revoked_at is not None
            assert repo.revoke_token(s, w.id).revoked_at == revoked.revoked_at
            assert repo.check_token(s, "s3cret-write-token") is None
            assert [t.name for t in repo.list_tokens(s)] == ["ci", "dash"]
            with pytest.raises(NotFoundError):
                repo.revoke_token(s, 10_000)

    def test_session_translates_errors(self, database: Database) -> None:
        with database.session() as s:
            add_device(s)
        with pytest.raises(DuplicateError, match="integrity"):
            with database.session() as s:
                s.execute(
                    insert(Device).values(
                        key="dev-a",
                        platform="cpu",
                        device_kind="cpu",
                        num_devices=1,
                        num_processes=1,
                        topology=None,
                        jax_version="1",
                        jaxlib_version="1",
                        created_at=T0,
                    )
                )
        with pytest.raises(StorageError) as excinfo:
            with database.session() as s:
                s.execute(select(func.no_such_function()))
        assert not isinstance(excinfo.value, DuplicateError)
        with pytest.raises(KeyError):  # other errors pass through, after a rollback
            with database.session() as s:
                add_device(s, key="rolled-back")
                raise KeyError("x")
        with session_scope(database.engine) as s:
            assert repo.get_device_by_key(s, "rolled-back") is None

    def test_timestamps_round_trip_as_utc(self, database: Database) -> None:
        plus_two = datetime(2026, 6, 1, 14, 0, tzinfo=timezone(timedelta(hours=2)))
        with database.session() as s:
            job = repo.enqueue_job(
                s, problem_key="p", problem={}, device_key="d", device={}, now=plus_two
            )
            claimed = repo.claim_job(s, "w", 1.5, now=datetime(2026, 6, 1, 12, 0))  # naive = UTC
        assert job.created_at == datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
        assert job.created_at.tzinfo is not None and job.created_at.utcoffset() == timedelta(0)
        assert claimed is not None
        assert claimed.lease_expires_at == datetime(2026, 6, 1, 12, 0, 1, 500_000, tzinfo=UTC)


# --------------------------------------------------------------------------- the rule


class TestChooseWinner:
    def test_no_measurements(self) -> None:
        assert choose_winner([]) is None

    def test_baseline_is_default(self) -> None:
        w = choose_winner(
            [mrec(1, BASELINE, median=0.02), mrec(2, RING, ratio=1.5, lo=1.0, hi=2.0)]
        )
        assert w is not None and w.strategy == BASELINE and w.speedup == 1.0
        assert (w.baseline_s, w.winner_s, w.measurement_id) == (0.02, 0.02, 1)

    def test_ci_strictly_above_one_wins(self) -> None:
        w = choose_winner([mrec(1, BASELINE), mrec(2, RING, ratio=1.2, lo=1.0001, hi=1.4)])
        assert w is not None and w.strategy == RING and w.measurement_id == 2

    def test_highest_median_speedup_among_qualifying(self) -> None:
        w = choose_winner(
            [
                mrec(1, BASELINE),
                mrec(2, RING, ratio=1.3, lo=1.25, hi=1.35),  # tighter but slower
                mrec(3, BIDI, ratio=1.5, lo=1.05, hi=1.9),
                mrec(4, {"method": "ring", "chunks": 8}, ratio=1.9, lo=0.8, hi=2.5),  # noise
            ]
        )
        assert w is not None and w.strategy == BIDI and w.speedup == 1.5 and w.trials == 4

    def test_latest_per_strategy(self) -> None:
        old_good = mrec(2, RING, ratio=1.5, lo=1.3, hi=1.7, at=T0)
        new_bad = mrec(3, RING, ratio=1.0, lo=0.9, hi=1.1, at=T0 + timedelta(hours=1))
        w = choose_winner([mrec(1, BASELINE), new_bad, old_good])
        assert w is not None and w.strategy == BASELINE and w.measurement_ids == (1, 3)
        # ties in time: the higher id is the later one
        a = mrec(5, RING, ratio=1.0, lo=0.9, hi=1.1, at=T0)
        b = mrec(6, RING, ratio=1.5, lo=1.3, hi=1.7, at=T0)
        assert choose_winner([b, mrec(1, BASELINE), a]).strategy == RING  # type: ignore[union-attr]

    def test_a_winners_times_come_from_its_own_session(self) -> None:
        """The search's first batch: baseline 13.19 ms, the ring 1.25x at 10.55 ms; a later batch
        times the baseline at 16 ms (a slower moment) and another ring at 1.05x. The row's times
        are the first session's, and the speedup is their ratio (a tune row once showed 1.536x
        with the winner's median above the latest baseline's)."""
        w = choose_winner([mrec(1, BASELINE, median=0.01319, at=T0),
                           mrec(2, RING, ratio=1.25, lo=1.1, hi=1.4, median=0.010552, at=T0),
                           mrec(3, BASELINE, median=0.016, at=T0 + timedelta(minutes=5)),
                           mrec(4, BIDI, ratio=1.05, lo=0.98, hi=1.1, median=0.0152, at=T0 + timedelta(minutes=5))])
        assert w is not None and w.strategy == RING
        assert w.baseline_s == pytest.approx(0.01319) and w.winner_s == 0.010552
        assert w.speedup == pytest.approx(w.baseline_s / w.winner_s) and w.winner_s < w.baseline_s

    def test_a_winner_carries_its_own_measurements_split(self) -> None:
        """The winner's serial_s/traffic_speedup are its winning measurement's (one session's
        samples), so traffic x overlap is its speedup; a measurement without a control (and the
        baseline) has none."""
        w = choose_winner([mrec(1, BASELINE), mrec(2, RING, ratio=1.3, lo=1.2, hi=1.4, traffic=1.04),
                           mrec(3, BIDI, ratio=1.1, lo=1.05, hi=1.2, traffic=0.9)])
        assert w is not None and w.strategy == RING and w.traffic_speedup == 1.04
        assert w.serial_s == pytest.approx(0.01 * 1.3 / 1.04)
        w = choose_winner([mrec(1, BASELINE), mrec(2, RING, ratio=1.3, lo=1.2, hi=1.4)])
        assert w is not None and w.traffic_speedup is None and w.serial_s is None
        w = choose_winner([mrec(1, BASELINE), mrec(2, RING, ratio=1.3, lo=0.9, hi=1.4, traffic=1.1)])
        assert w is not None and w.strategy == BASELINE and w.traffic_speedup is None

    def test_noise_never_wins_and_an_undecided_ring_is_said_to_be(self) -> None:
        """A ring must clear 1.0 plus its session's A/A noise: 1.05x [1.02, 1.09] beside an A/A
        of +/-6% is a coin flip, so the baseline stays and `why_unresolved` says why (its interval
        reaches past the floor); 1.25x [1.12, 1.30] wins; 1.01x [0.98, 1.05] is no effect (resolved)."""
        from db.apply_rule import why_unresolved

        flip = [mrec(1, BASELINE, aa=0.06), mrec(2, RING, ratio=1.05, lo=1.02, hi=1.09, aa=0.06)]
        w = choose_winner(flip)
        assert w is not None and w.strategy == BASELINE
        why = why_unresolved(flip)
        assert why is not None and "1.050x [1.020, 1.090]" in why and "+/-6.0%" in why
        assert choose_winner([*flip[:1], mrec(2, RING, ratio=1.05, lo=1.02, hi=1.09)]).strategy == RING  # no twin
        clear = [mrec(1, BASELINE, aa=0.06), mrec(2, RING, ratio=1.25, lo=1.12, hi=1.30, aa=0.06)]
        assert choose_winner(clear).strategy == RING and why_unresolved(clear) is None
        none = [mrec(1, BASELINE, aa=0.06), mrec(2, RING, ratio=1.01, lo=0.98, hi=1.05, aa=0.06)]
        assert choose_winner(none).strategy == BASELINE and why_unresolved(none) is None

    def test_failed_latest_excludes_strategy(self) -> None:
        w = choose_winner(
            [mrec(1, BASELINE), mrec(2, RING, ratio=1.5, lo=1.3), mrec(3, RING, status="failed")]
        )
        assert w is not None and w.strategy == BASELINE

    def test_no_successful_baseline_and_nothing_qualifies(self) -> None:
        assert (
            choose_winner([mrec(1, BASELINE, status="failed"), mrec(2, RING, ratio=1.1, lo=0.9)])
            is None
        )
        w = choose_winner([mrec(1, BASELINE, status="failed"), mrec(2, RING, ratio=1.4, lo=1.2)])
        assert w is not None and w.strategy == RING and w.baseline_s == pytest.approx(1.4 * 0.01)

    @settings(max_examples=200, deadline=None)
    @given(
        st.lists(
            st.tuples(
                st.sampled_from(["baseline", "ring", "bidirectional", "ring8"]),
                st.booleans(),
                st.floats(0.5, 2.0),
                st.floats(0.0, 0.5),
            ),
            max_size=12,
        )
    )
    def test_properties(self, rows: list[tuple[str, bool, float, float]]) -> None:
        ms = [
            mrec(
                i + 1,
                {"method": name} if name != "ring8" else {"method": "ring", "chunks": 8},
                status="ok" if ok else "failed",
                ratio=None if name == "baseline" else r,
                lo=None if name == "baseline" else r - width,
                hi=None if name == "baseline" else r + width,
            )
            for i, (name, ok, r, width) in enumerate(rows)
        ]
        shuffled = random.Random(len(ms)).sample(ms, len(ms))
        w = choose_winner(shuffled)  # the order of the input never matters
        latest: dict[str, MeasurementRecord] = {}
        for m in ms:
            latest[m.strategy_key] = m
        ok = [m for m in latest.values() if m.status == "ok"]
        qualifying = [
            m for m in ok if m.method != "baseline" and m.ratio_lo is not None and m.ratio_lo > 1.0
        ]
        if w is None:
            assert not qualifying and not any(m.method == "baseline" for m in ok)
            return
        assert w.trials == len(ms) and set(w.measurement_ids) == {m.id for m in latest.values()}
        if qualifying:
            assert w.speedup == max(m.ratio for m in qualifying)  # type: ignore[type-var]
            assert w.speedup_lo is not None and w.speedup_lo > 1.0
        else:
            assert w.method == "baseline" and w.speedup == 1.0


# --------------------------------------------------------------------------- settings


class TestSettings:
    @pytest.mark.parametrize(
        ("given_url", "expected"),
        [
            ("postgres://u:p@h:5432/db", "postgresql+psycopg://u:p@h:5432/db"),
            ("postgresql://u:p@h/db", "postgresql+psycopg://u:p@h/db"),
            ("postgresql+psycopg://u:p@h/db", "postgresql+psycopg://u:p@h/db"),
            ("sqlite:///rel.db", "sqlite:///rel.db"),
            (":memory:", "sqlite://"),
        ],
    )
    def test_url_normalisation(self, given_url: str, expected: str) -> None:
        assert normalize_db_url(given_url) == expected

    def test_bare_path_becomes_absolute_sqlite_url(
        self, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.chdir(tmp_path)
        assert normalize_db_url("x/results.db") == f"sqlite:///{tmp_path / 'x' / 'results.db'}"
        monkeypatch.delenv("AUTOTUNER_DB_URL", raising=False)
        assert Settings().db_url == f"sqlite:///{tmp_path / 'autotuner.db'}"
        with pytest.raises(ValueError, match="empty"):
            normalize_db_url("  ")

    def test_environment(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("AUTOTUNER_DB_URL", "postgres://u:hunter2@h/db")
        monkeypatch.setenv("AUTOTUNER_WRITE_TOKENS", " a, b ,,c")
        monkeypatch.setenv("AUTOTUNER_MAX_BATCH", "10")
        monkeypatch.delenv("AUTOTUNER_READ_TOKENS", raising=False)
        s = Settings()
        assert s.db_url == "postgresql+psycopg://u:hunter2@h/db"
        assert (s.write_tokens, s.read_tokens) == (["a", "b", "c"], [])
        assert (s.max_batch, s.max_body_bytes, s.lease_seconds) == (10, 1_000_000, 300.0)
        assert "hunter2" not in repr(s) and "'a'" not in repr(s)
        monkeypatch.setenv("AUTOTUNER_READ_TOKENS", '["x", " y"]')
        assert Settings().read_tokens == ["x", "y"]
        assert Settings(write_tokens="p,q").write_tokens == ["p", "q"]

    def test_get_settings_is_cached(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from autotuner.settings import get_settings

        get_settings.cache_clear()
        monkeypatch.setenv("AUTOTUNER_MAX_BATCH", "7")
        try:
            assert get_settings() is get_settings() and get_settings().max_batch == 7
        finally:
            get_settings.cache_clear()

    def test_a_variable_that_does_not_hold_its_field_is_one_named_error(
        self, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A bad AUTOTUNER_* value was pydantic's ValidationError, a traceback from every command;
        now SettingsError (an AutotunerError: the CLI's one line) names the variable, hiding a
        password, and an empty variable is the default (AUTOTUNER_DB_URL= was "database URL is
        empty")."""
        from autotuner.errors import AutotunerError
        from autotuner.settings import SettingsError, get_settings

        monkeypatch.chdir(tmp_path)
        monkeypatch.setenv("AUTOTUNER_MAX_BATCH", "abc")
        monkeypatch.setenv("AUTOTUNER_LOOKUP_POLL_SECONDS", "-1")
        monkeypatch.setenv("AUTOTUNER_DB_URL", "")
        get_settings.cache_clear()
        try:
            with pytest.raises(SettingsError) as e:
                get_settings()
            said = str(e.value)
            assert isinstance(e.value, AutotunerError) and isinstance(e.value, ValueError)
            assert "AUTOTUNER_MAX_BATCH='abc': Input should be a valid integer" in said, said
            assert "AUTOTUNER_LOOKUP_POLL_SECONDS='-1': Input should be greater than 0" in said, said
            monkeypatch.delenv("AUTOTUNER_MAX_BATCH")
            monkeypatch.delenv("AUTOTUNER_LOOKUP_POLL_SECONDS")
            get_settings.cache_clear()
            assert get_settings().db_url == f"sqlite:///{tmp_path / 'autotuner.db'}"
            monkeypatch.setenv("AUTOTUNER_DB_URL", "   ")   # blank, not empty: still refused, by name
            get_settings.cache_clear()
            with pytest.raises(SettingsError, match="AUTOTUNER_DB_URL='   ': database URL is empty"):
                get_settings()
        finally:
            get_settings.cache_clear()

    def test_memory_database(self) -> None:
        from db import upgrade

        with Database(":memory:") as database:
            upgrade(database.engine)
            database.check_schema()
            with database.session() as s:
                assert add_device(s).id == 1


# --------------------------------------------------------------------------- scale


@pytest.mark.slow
def test_nearest_is_two_statements_served_by_the_index(database: Database, backend: str) -> None:
    """20k problems over 4 patterns, all tuned on one device. A nearest lookup is two SQL
    statements whatever the number of problems (the device's id; the neighbours, sorted and
    cut to ``limit`` by the database), the database can serve its (pattern, dtype, mesh size)
    prefilter from ix_problems_nearest, and with ``max_distance`` one page of the ball is read.
    None of that depends on the count (20k: enough for a ball wider than a page); how long a
    lookup takes at 100k or more is a figure for bench/, not an assertion."""
    rng = random.Random(0)
    n_problems = 20_000
    patterns = [
        PATTERN,
        "all_gather:rhs:free",
        "reduce_scatter:out:free",
        "reduce_scatter:out:batch",
    ]
    with database.session() as s:
        dev = add_device(s)
        problems = []
        for i in range(n_problems):
            m, n, k = (2 ** rng.uniform(6, 16) for _ in range(3))
            b = float(rng.choice([1, 2, 4, 8]))
            problems.append(
                {
                    "key": f"p{i}",
                    "canonical": {},
                    "equation": "bmk,kn->bmn",
                    "pattern": patterns[i % 4],
                    "dtype": "bfloat16",
                    "mesh_size": 8,
                    "m": m,
                    "n": n,
                    "k": k,
                    "b": b,
                    "flops": 2 * b * m * n * k,
                    "comm_bytes": 2 * b * m * k,
                    "lm": math.log2(m),
                    "ln": math.log2(n),
                    "lk": math.log2(k),
                    "lb": math.log2(b),
                    "created_at": T0,
                }
            )
        s.execute(insert(Problem), problems)
        every_problem = select(
            literal(dev.id, Integer),
            Problem.id,
            literal(BASELINE, JSON),
            literal("baseline"),
            literal("baseline"),
            literal(1.0, Double),
            literal([], JSON),
            literal(1, Integer),
            literal(T0, UTCDateTime()),
            literal(T0, UTCDateTime()),
        )
        columns = [
            "device_id", "problem_id", "strategy", "strategy_key", "method", "speedup",
            "measurement_ids", "trials", "created_at", "updated_at",
        ]  # fmt: skip
        s.execute(insert(Winner).from_select(columns, every_problem))
    query = {"pattern": PATTERN, "dtype": "bfloat16", "mesh_size": 8}
    shape = {"m": 3000, "n": 500, "k": 20000, "b": 2}
    statements: list[tuple[str, Any]] = []

    def record(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any,
               executemany: bool) -> None:
        statements.append((statement, parameters))

    with database.session(read_only=True) as s:
        # a first lookup: the transaction has begun (its BEGIN is not counted below)
        repo.nearest_winners(s, "dev-a", m=1000, n=1000, k=1000, b=1, **query)
        event.listen(database.engine, "before_cursor_execute", record)
        try:
            near = repo.nearest_winners(s, "dev-a", **shape, **query)
            plain = list(statements)
            statements.clear()
            in_ball = repo.nearest_winners(s, "dev-a", **shape, **query, max_distance=2.0)
            ball = list(statements)
        finally:
            event.remove(database.engine, "before_cursor_execute", record)
        # the device's id, then one statement for the neighbours: no query per row or problem
        assert len(plain) == 2, [st for st, _ in plain]
        neighbours = plain[1][0]
        assert "ORDER BY" in neighbours and "LIMIT" in neighbours  # sorted and cut in SQL
        # the device, one page of the ball and its winners, the neighbours
        assert len(ball) == 4, [st for st, _ in ball]
        conn = s.connection()
        if backend == "postgres":  # the planner may prefer a scan of so few pages: is the index usable?
            conn.exec_driver_sql("SET LOCAL enable_seqscan = off")
        explain = "EXPLAIN QUERY PLAN" if backend == "sqlite" else "EXPLAIN"
        for statement, parameters in (plain[1], ball[1]):  # the neighbours; the ball's first page
            plan = "\n".join(str(r[-1]) for r in conn.exec_driver_sql(f"{explain} {statement}", parameters))
            assert "ix_problems_nearest" in plan, plan
    target = (math.log2(3000), math.log2(500), math.log2(20000), 1.0)
    best = sorted(
        (math.dist(target, (p["lm"], p["ln"], p["lk"], p["lb"])), p["key"])
        for p in problems
        if p["pattern"] == PATTERN
    )[:5]
    assert [nb.problem.key for nb in near] == [key for _, key in best]
    assert [nb.distance for nb in near] == pytest.approx([d for d, _ in best])
    assert [nb.problem.key for nb in in_ball] == [key for _, key in best]  # all within 2.0


# --------------------------------------------------------------------------- concurrency

N_PROCS = 4
N_JOBS = 40
ROUNDS = 3
PROBLEM_KEYS = [f"cp{i}" for i in range(4)]


def _concurrent_worker(url: str, worker: str, seed: int, barrier: Any, results: Any) -> None:
    """One of N_PROCS processes: upserts the same rows, records measurements, recomputes the
    same winners and claims jobs, all at once with the others."""
    rng = random.Random(seed)
    claimed: list[int] = []
    errors: list[str] = []
    database = Database(url)
    try:
        barrier.wait(timeout=60)
        for _ in range(ROUNDS):
            for key in rng.sample(PROBLEM_KEYS, len(PROBLEM_KEYS)):
                with database.session() as s:
                    d = add_device(s, key="cdev")
                    p = add_problem(s, key)
                    ratio = rng.uniform(0.9, 1.5)
                    repo.record_measurements(
                        s,
                        d.id,
                        p.id,
                        [
                            item(BASELINE),
                            item(
                                rng.choice([RING, BIDI]),
                                ratio=ratio,
                                lo=ratio - 0.1,
                                hi=ratio + 0.1,
                            ),
                        ],
                    )
                    repo.recompute_winner(s, d.id, p.id)
                with database.session() as s:
                    job = repo.claim_job(s, worker, 60)
                if job is not None:
                    claimed.append(job.id)
                    with database.session() as s:
                        repo.heartbeat_job(s, job.id, worker, 60)
                        repo.finish_job(s, job.id, worker, "done")
        while True:
            with database.session() as s:
                job = repo.claim_job(s, worker, 60)
            if job is None:
                break
            claimed.append(job.id)
            with database.session() as s:
                repo.finish_job(s, job.id, worker, "done")
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        database.dispose()
        results.put({"worker": worker, "claimed": claimed, "errors": errors})


def test_concurrent_processes_never_duplicate_or_deadlock(database: Database) -> None:
    with database.session() as s:
        job_ids = {
            repo.enqueue_job(s, problem_key=f"jp{i}", problem={}, device_key="cdev", device={}).id
            for i in range(N_JOBS)
        }
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(N_PROCS)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_concurrent_worker, args=(database.url, f"w{i}", i, barrier, results))
        for i in range(N_PROCS)
    ]
    for p in procs:
        p.start()
    outs = []
    try:
        for _ in procs:
            outs.append(results.get(timeout=120))
    except queue.Empty:
        pytest.fail(f"workers did not finish; got {outs}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
        results.join_thread()
    assert [o["errors"] for o in outs] == [[]] * N_PROCS
    claimed = [j for o in outs for j in o["claimed"]]
    assert len(claimed) == len(set(claimed)), "a job was claimed twice"
    assert set(claimed) == job_ids
    with database.session(read_only=True) as s:
        jobs = repo.list_jobs(s, limit=N_JOBS).items
        assert {(j.status, j.attempts) for j in jobs} == {("done", 1)}
        assert {j.worker for j in jobs} <= {f"w{i}" for i in range(N_PROCS)}
        assert s.scalar(select(func.count()).select_from(Winner)) == len(PROBLEM_KEYS)
        assert len(repo.list_devices(s)) == 1
        device = repo.get_device_by_key(s, "cdev")
        assert device is not None
        for key in PROBLEM_KEYS:
            problem = repo.get_problem_by_key(s, key)
            assert problem is not None
            ms = repo.list_measurements(s, problem.id, device.id)
            assert len(ms) == 2 * N_PROCS * ROUNDS
            stored = repo.get_winner(s, "cdev", key)
            expected = choose_winner(ms)
            assert stored is not None and expected is not None
            assert (stored.strategy_key, stored.speedup, stored.measurement_ids) == (
                expected.strategy_key,
                expected.speedup,
                expected.measurement_ids,
            )


# --------------------------------------------------------------------------- engines


class TestEngines:
    def test_pragmas_and_begin_modes(self, tmp_path: Any) -> None:
        from sqlalchemy import event, text

        from db import make_engine, upgrade

        engine = make_engine(tmp_path / "x.db")  # a bare path is a SQLite file
        try:
            upgrade(engine)
            begins: list[str] = []

            @event.listens_for(engine, "before_cursor_execute")
            def _seen(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
                if statement.startswith("BEGIN"):
                    begins.append(statement)

            with session_scope(engine) as s:
                pragmas = [
                    s.execute(text(f"PRAGMA {p}")).scalar()
                    for p in ("journal_mode", "busy_timeout", "foreign_keys")
                ]
            with session_scope(engine, read_only=True) as s:
                repo.list_devices(s)
            assert pragmas == ["wal", 30000, 1]
            assert begins == ["BEGIN IMMEDIATE", "BEGIN DEFERRED"]
        finally:
            engine.dispose()

    def test_foreign_keys_are_enforced(self, database: Database, backend: str) -> None:
        from db.tables import Measurement

        with pytest.raises(DuplicateError), database.session() as s:
            s.add(
                Measurement(
                    problem_id=999, device_id=999, strategy=BASELINE, strategy_key="b",
                    method="baseline", status="failed", samples=[],
                )
            )  # fmt: skip

    def test_unsupported_url(self) -> None:
        from db import URLError, make_engine

        with pytest.raises(URLError, match="unsupported database URL") as e:
            make_engine("mysql://u:secret@h/db")
        assert isinstance(e.value, ValueError) and "secret" not in str(e.value)
        with pytest.raises(URLError, match="does not parse") as e:
            make_engine("postgresql://u:secret@h:port/db")
        assert "secret" not in str(e.value)

"""Aggregates for the dashboard (private; import from :mod:`db.repository`).

Every function here summarises in SQL and returns a bounded amount of data, whatever the number
of stored problems: counts per group, a binned histogram, a sample of at most ``limit`` points.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Integer, case, cast, func, select
from sqlalchemy.orm import Session

from db._common import dialect, finite
from db._convert import winner_record
from db.records import WinnerRecord
from db.tables import JOB_STATUSES, Device, Problem, TuningJob, Winner

__all__ = [
    "Facets",
    "ShapePoint",
    "ShapeSample",
    "SpeedupBin",
    "TunedCount",
    "job_counts",
    "problem_facets",
    "problem_winners",
    "shape_sample",
    "speedup_histogram",
    "tuned_counts",
]

MAX_SAMPLE = 20_000
MAX_BINS = 400


@dataclass(frozen=True, slots=True)
class TunedCount:
    """Winners stored for one (device, pattern): ``problems`` in all, ``decomposed`` of them won
    by a strategy other than the baseline, ``best_speedup`` the highest winning speedup."""

    device_id: int
    device_key: str
    platform: str
    device_kind: str
    num_devices: int
    topology: str | None
    pattern: str
    problems: int
    decomposed: int
    best_speedup: float


@dataclass(frozen=True, slots=True)
class SpeedupBin:
    """Winners whose speedup lies in ``[lo, hi)``, by winning ``method`` and ``direction`` (the
    strategy's ``"direction"``, ``None`` if it has none). ``hi`` is ``None`` for the last,
    open-ended bin (speedups of ``upper`` and more)."""

    lo: float
    hi: float | None
    method: str
    direction: str | None
    count: int


@dataclass(frozen=True, slots=True)
class ShapePoint:
    problem_id: int
    device_key: str
    equation: str
    pattern: str
    dtype: str
    mesh_size: int
    flops: float
    comm_bytes: float
    speedup: float
    speedup_lo: float | None
    speedup_hi: float | None
    method: str
    direction: str | None


@dataclass(frozen=True, slots=True)
class ShapeSample:
    """At most ``limit`` of the ``total`` matching winners (every ``stride``-th by id)."""

    points: tuple[ShapePoint, ...]
    total: int
    stride: int


@dataclass(frozen=True, slots=True)
class Facets:
    """The distinct values the problems table can be filtered by."""

    patterns: tuple[str, ...]
    dtypes: tuple[str, ...]
    methods: tuple[str, ...]


def _device_id(s: Session, device_key: str | None) -> int | None:
    if device_key is None:
        return None
    found = s.execute(select(Device.id).where(Device.key == device_key)).scalar_one_or_none()
    return found if found is not None else -1  # matches nothing


def _direction() -> Any:
    return Winner.strategy["direction"].as_string()


def tuned_counts(s: Session) -> list[TunedCount]:
    """Stored winners per (device, problem pattern), by device id then pattern."""
    stmt = (
        select(
            Winner.device_id,
            Problem.pattern,
            func.count(Winner.id),
            func.sum(case((Winner.method != "baseline", 1), else_=0)),
            func.max(Winner.speedup),
        )
        .join(Problem, Winner.problem_id == Problem.id)
        .group_by(Winner.device_id, Problem.pattern)  # devices joined after: a narrower sort
    )
    groups = list(s.execute(stmt))
    ids = sorted({g[0] for g in groups})
    devices = {d.id: d for d in s.scalars(select(Device).where(Device.id.in_(ids)))} if ids else {}
    out = [
        TunedCount(device_id=d.id, device_key=d.key, platform=d.platform,
                   device_kind=d.device_kind, num_devices=d.num_devices, topology=d.topology,
                   pattern=pattern, problems=int(n), decomposed=int(dec or 0),
                   best_speedup=float(best))
        for device_id, pattern, n, dec, best in groups
        if (d := devices.get(device_id)) is not None
    ]
    return sorted(out, key=lambda c: (c.device_id, c.pattern))


def speedup_histogram(
    s: Session, *, width: float = 0.05, upper: float = 3.0, device_key: str | None = None
) -> list[SpeedupBin]:
    """Winning speedups binned in SQL: bins ``[i*width, (i+1)*width)`` below ``upper``, one
    open-ended bin from ``upper`` on; per bin one entry per (method, direction), non-empty bins
    only, ordered by bin then method then direction."""
    w = finite(width, "width", minimum=0.0)
    top = finite(upper, "upper", minimum=0.0)
    assert w is not None and top is not None
    if w <= 0 or top <= 0:
        raise ValueError("width and upper must be > 0")
    if top / w > MAX_BINS:
        raise ValueError(f"upper / width must be at most {MAX_BINS} bins")
    last = math.ceil(top / w - 1e-9)  # index of the open-ended bin
    scaled = Winner.speedup / w + 1e-9  # 1.15 / 0.05 is 22.999...: a bin edge stays in its bin
    # speedups are > 0: truncation is floor; PostgreSQL's CAST rounds, so floor there
    index = func.floor(scaled) if dialect(s) == "postgresql" else scaled
    rows = select(
        case((Winner.speedup >= top, last), else_=cast(index, Integer)).label("bin"),
        Winner.method.label("method"),
        _direction().label("direction"),
    )
    device_id = _device_id(s, device_key)
    if device_id is not None:
        rows = rows.where(Winner.device_id == device_id)
    # group the subquery's columns: PostgreSQL cannot match an expression with bound
    # parameters in GROUP BY to the same expression in the select list
    sub = rows.subquery()
    stmt = select(sub.c.bin, sub.c.method, sub.c.direction, func.count()).group_by(
        sub.c.bin, sub.c.method, sub.c.direction
    )
    out = []
    for b, method, d, count in s.execute(stmt):
        i = min(int(b), last)
        lo, hi = (round(i * w, 12), round(min((i + 1) * w, top), 12)) if i < last else (top, None)
        out.append(SpeedupBin(lo=lo, hi=hi, method=method, direction=d, count=int(count)))
    return sorted(out, key=lambda x: (x.lo, x.method, x.direction or ""))


def shape_sample(
    s: Session, *, limit: int = 2000, device_key: str | None = None
) -> ShapeSample:
    """Winners with their problem's size (flops, bytes moved): all of them up to ``limit``, else
    every ``stride``-th winner by id (``stride = ceil(total / limit)``), so the sample is spread
    over the whole table and costs the same at 100k problems as at 1k."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_SAMPLE:
        raise ValueError(f"limit must be an integer in 1..{MAX_SAMPLE}, not {limit!r}")
    device_id = _device_id(s, device_key)
    count = select(func.count(Winner.id))
    if device_id is not None:
        count = count.where(Winner.device_id == device_id)
    total = int(s.execute(count).scalar_one())
    stride = max(1, math.ceil(total / limit))
    stmt = (
        select(Winner.problem_id, Device.key, Problem.equation, Problem.pattern, Problem.dtype,
               Problem.mesh_size, Problem.flops, Problem.comm_bytes, Winner.speedup,
               Winner.speedup_lo, Winner.speedup_hi, Winner.method, _direction())
        .select_from(Winner)
        .join(Device, Winner.device_id == Device.id)
        .join(Problem, Winner.problem_id == Problem.id)
        .order_by(Winner.id)
        .limit(limit)
    )
    if device_id is not None:
        stmt = stmt.where(Winner.device_id == device_id)
    if stride > 1:
        stmt = stmt.where(Winner.id % stride == 0)
    points = tuple(
        ShapePoint(problem_id=r[0], device_key=r[1], equation=r[2], pattern=r[3], dtype=r[4],
                   mesh_size=r[5], flops=r[6], comm_bytes=r[7], speedup=r[8], speedup_lo=r[9],
                   speedup_hi=r[10], method=r[11], direction=r[12])
        for r in s.execute(stmt)
    )
    return ShapeSample(points=points, total=total, stride=stride)


def problem_facets(s: Session) -> Facets:
    """Distinct problem patterns and dtypes, and winning methods, each sorted."""

    def values(col: Any) -> tuple[str, ...]:
        return tuple(s.scalars(select(col).distinct().order_by(col)))

    return Facets(patterns=values(Problem.pattern), dtypes=values(Problem.dtype),
                  methods=values(Winner.method))


def job_counts(s: Session) -> dict[str, int]:
    """Tuning jobs per status; every status present (0 when none)."""
    counts = dict.fromkeys(JOB_STATUSES, 0)
    stmt = select(TuningJob.status, func.count(TuningJob.id)).group_by(TuningJob.status)
    for status, n in s.execute(stmt):
        counts[status] = int(n)
    return counts


def problem_winners(s: Session, problem_id: int) -> list[WinnerRecord]:
    """The stored winner of one problem on every device, by device id."""
    stmt = (
        select(Winner, Device.key, Problem.key)
        .join(Device, Winner.device_id == Device.id)
        .join(Problem, Winner.problem_id == Problem.id)
        .where(Winner.problem_id == problem_id)
        .order_by(Winner.device_id)
    )
    return [winner_record(*r) for r in s.execute(stmt)]

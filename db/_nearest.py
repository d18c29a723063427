"""The winners of the problems nearest in log-shape space (private; see :mod:`db.repository`).

What the service answers ``nearest`` from when a shape was never tuned on a device.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator

from sqlalchemy import select
from sqlalchemy.orm import Session

from db._catalog import EXTENTS, log_feature
from db._common import check_page, finite
from db._convert import problem_record, winner_record
from db.fields import INT_MAX
from db.records import Neighbor
from db.tables import Device, Problem, Winner


def _storable(mesh_size: int) -> bool:
    """Whether a stored problem can have this mesh size (one outside the column's range cannot,
    and SQLite cannot even compare it)."""
    return not isinstance(mesh_size, int) or abs(mesh_size) <= INT_MAX


def nearest_winners(
    s: Session,
    device_key: str,
    *,
    pattern: str,
    dtype: str,
    mesh_size: int,
    m: float,
    n: float,
    k: float,
    b: float,
    limit: int = 5,
    exclude_key: str | None = None,
    max_distance: float | None = None,
) -> list[Neighbor]:
    """The ``limit`` winners on this device of problems closest in log-shape space.

    Only problems with the same ``pattern``, ``dtype`` and ``mesh_size`` count (an indexed
    prefilter); the distance is the Euclidean distance over log2 of (m, n, k, b), computed
    in SQL from the stored log features and ordered there (ties: lower problem id).
    ``exclude_key`` leaves one problem out (e.g. the one being looked up). ``max_distance``
    drops neighbours farther than that; it also bounds every log feature to a box around
    the target, which the (pattern, dtype, mesh_size, lm, ln, lk, lb) index serves, so only
    the problems in the ball are read (not every problem of a large group).
    """
    check_page(0, limit)
    if not _storable(mesh_size):
        return []
    device_id = s.execute(select(Device.id).where(Device.key == device_key)).scalar_one_or_none()
    if device_id is None:
        return []
    extents = dict(zip(EXTENTS, (m, n, k, b), strict=True))
    target = {"l" + e: log_feature(finite(v, e, minimum=0.0) or 0.0) for e, v in extents.items()}
    terms = [
        (getattr(Problem, col) - value) * (getattr(Problem, col) - value)
        for col, value in target.items()
    ]
    d2 = functools.reduce(operator.add, terms).label("d2")
    stmt = (
        select(Winner, Problem, d2)
        .join(Problem, Winner.problem_id == Problem.id)
        .where(
            Winner.device_id == device_id,
            Problem.pattern == pattern,
            Problem.dtype == dtype,
            Problem.mesh_size == mesh_size,
        )
        .order_by(d2, Problem.id)
        .limit(limit)
    )
    if exclude_key is not None:
        stmt = stmt.where(Problem.key != exclude_key)
    if max_distance is not None:
        # the problems in the ball, closest first, from the index alone (it holds every column
        # this reads), a page at a time until limit + 1 of them have a winner on this device
        # (+ 1: exclude_key may be one); only those rows are fetched in full
        r = finite(max_distance, "max_distance", minimum=0.0)
        in_ball = (
            select(Problem.id)
            .where(Problem.pattern == pattern, Problem.dtype == dtype, Problem.mesh_size == mesh_size,
                   *(getattr(Problem, col).between(value - r, value + r) for col, value in target.items()),
                   d2 <= r * r)
            .order_by(d2, Problem.id)
        )
        top: list[int] = []
        page = 64
        for lo in itertools.count(0, page):
            chunk = list(s.execute(in_ball.limit(page).offset(lo)).scalars())
            tuned = set(s.execute(select(Winner.problem_id).where(
                Winner.device_id == device_id, Winner.problem_id.in_(chunk))).scalars()) if chunk else set()
            top += [pid for pid in chunk if pid in tuned]
            if len(top) > limit or len(chunk) < page:
                break
        stmt = stmt.where(Problem.id.in_(top[: limit + 1]))
    out = []
    for winner, problem, dist2 in s.execute(stmt):
        out.append(
            Neighbor(
                winner=winner_record(winner, device_key, problem.key),
                problem=problem_record(problem),
                distance=math.sqrt(max(float(dist2), 0.0)),
            )
        )
    return out


def tuned_group(
    s: Session, device_key: str, *, pattern: str, dtype: str, mesh_size: int
) -> list[tuple[int, str, float, float, float, float]]:
    """``(problem id, problem key, lm, ln, lk, lb)`` of every problem of one (pattern, dtype,
    mesh size) group that has a winner on this device, by problem id: what an in-memory
    nearest-shape index of the group holds (the service's :mod:`service.nearest`). One query,
    served by the (pattern, dtype, mesh_size, ...) index and the winners' unique index."""
    if not _storable(mesh_size):
        return []
    p, w = Problem.__table__.c, Winner.__table__.c  # Core: plain rows, no ORM layer (8k rows)
    device_id = select(Device.__table__.c.id).where(Device.__table__.c.key == device_key).scalar_subquery()
    stmt = (
        select(p.id, p.key, p.lm, p.ln, p.lk, p.lb)
        .join(Winner.__table__, w.problem_id == p.id)
        .where(w.device_id == device_id, p.pattern == pattern, p.dtype == dtype,
               p.mesh_size == mesh_size)
        .order_by(p.id)
    )
    return [tuple(r) for r in s.connection().execute(stmt)]  # type: ignore[misc]


def tuned_groups(s: Session) -> list[tuple[str, str, str, int]]:
    """Every ``(device key, pattern, dtype, mesh size)`` that has a winner: the groups an
    in-memory nearest index may read in advance."""
    p, w, d = Problem.__table__.c, Winner.__table__.c, Device.__table__.c
    stmt = (
        select(d.key, p.pattern, p.dtype, p.mesh_size).distinct()
        .select_from(Winner.__table__)
        .join(Problem.__table__, p.id == w.problem_id)
        .join(Device.__table__, d.id == w.device_id)
        .order_by(d.key, p.pattern, p.dtype, p.mesh_size)
    )
    return [tuple(r) for r in s.connection().execute(stmt)]  # type: ignore[misc]


def problem_groups(s: Session, problem_keys: list[str]) -> dict[str, tuple[str, str, int]]:
    """``{problem key: (pattern, dtype, mesh size)}`` of the stored problems among the keys."""
    p = Problem.__table__.c
    out: dict[str, tuple[str, str, int]] = {}
    for lo in range(0, len(problem_keys), 500):
        stmt = select(p.key, p.pattern, p.dtype, p.mesh_size).where(p.key.in_(problem_keys[lo:lo + 500]))
        out.update({r[0]: (r[1], r[2], r[3]) for r in s.connection().execute(stmt)})
    return out

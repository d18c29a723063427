"""Pages of (problem, device, winner) rows for the results table (private; see
:mod:`db.repository`): filtered, sorted and paged in SQL."""

from __future__ import annotations

from typing import Any

from sqlalchemy import and_, func, or_, select
from sqlalchemy.orm import Session

from db._common import check_page
from db._convert import device_record, problem_record, winner_record
from db.records import Page, ProblemRow
from db.tables import Device, Problem, Winner

SORT_KEYS = ("updated", "created", "speedup", "flops", "comm_bytes", "trials", "key", "pattern")


def _sort_column(sort: str) -> Any:
    columns = {
        "updated": func.coalesce(Winner.updated_at, Problem.created_at),
        "created": Problem.created_at,
        "speedup": Winner.speedup,
        "flops": Problem.flops,
        "comm_bytes": Problem.comm_bytes,
        "trials": Winner.trials,
        "key": Problem.key,
        "pattern": Problem.pattern,
    }
    try:
        return columns[sort]
    except KeyError:
        raise ValueError(f"sort must be one of {SORT_KEYS}, not {sort!r}") from None


def list_problems(
    s: Session,
    *,
    device_key: str | None = None,
    pattern: str | None = None,
    dtype: str | None = None,
    method: str | None = None,
    search: str | None = None,
    tuned_only: bool = True,
    sort: str = "updated",
    desc: bool = True,
    offset: int = 0,
    limit: int = 50,
) -> Page[ProblemRow]:
    """A page of (problem, device, winner) rows for a results table.

    By default one row per stored winner (a problem tuned on two devices gives two rows).
    ``tuned_only=False`` also lists problems without a (matching) winner, with ``device``
    and ``winner`` ``None``; with ``device_key`` that means one row per problem, carrying
    that device's winner if any. Filters: ``device_key``, ``pattern``, ``dtype``,
    ``method`` (the winner's method), ``search`` (problem key prefix or equation substring).
    ``sort`` is one of :data:`SORT_KEYS` (``"updated"`` = winner update time, else problem
    creation time); missing values sort last; ties by problem id.
    """
    check_page(offset, limit)
    sort_col = _sort_column(sort)
    on = Winner.problem_id == Problem.id
    if device_key is not None:
        device_id = s.execute(
            select(Device.id).where(Device.key == device_key)
        ).scalar_one_or_none()
        if device_id is None and tuned_only:
            return Page(items=(), total=0, offset=offset, limit=limit)
        on = and_(on, Winner.device_id == (device_id if device_id is not None else -1))
    if method is not None:
        on = and_(on, Winner.method == method)

    stmt = select(Problem, Winner, Device)
    if tuned_only or method is not None:
        stmt = stmt.join(Winner, on)
    else:
        stmt = stmt.outerjoin(Winner, on)
    stmt = stmt.outerjoin(Device, Device.id == Winner.device_id)
    if pattern is not None:
        stmt = stmt.where(Problem.pattern == pattern)
    if dtype is not None:
        stmt = stmt.where(Problem.dtype == dtype)
    if search:
        stmt = stmt.where(
            or_(
                Problem.key.startswith(search, autoescape=True),
                Problem.equation.contains(search, autoescape=True),
            )
        )

    total = s.execute(select(func.count()).select_from(stmt.subquery())).scalar_one()
    if sort == "updated" and (tuned_only or method is not None):
        sort_col = Winner.updated_at  # never null on an inner join, and indexed
    direction = (lambda c: c.desc()) if desc else (lambda c: c.asc())
    order = (direction(sort_col).nulls_last(), direction(Problem.id), direction(Winner.id).nulls_last())
    # Sort and page narrow (id) rows first, then load the full rows of just this page: sorting
    # whole rows with their JSON columns is what made deep pages of 100k problems slow.
    page_ids = s.execute(
        stmt.with_only_columns(Problem.id, Winner.id).order_by(*order).offset(offset).limit(limit)
    ).all()
    if not page_ids:
        return Page(items=(), total=total, offset=offset, limit=limit)
    pids = {p for p, _ in page_ids}
    wids = {w for _, w in page_ids if w is not None}
    problems = {p.id: p for p in s.scalars(select(Problem).where(Problem.id.in_(pids)))}
    winners = {w.id: w for w in s.scalars(select(Winner).where(Winner.id.in_(wids)))} if wids else {}
    dev_ids = {w.device_id for w in winners.values()}
    devices = {d.id: d for d in s.scalars(select(Device).where(Device.id.in_(dev_ids)))} if dev_ids else {}
    rows = []
    for pid, wid in page_ids:
        w = winners.get(wid) if wid is not None else None
        rows.append((problems[pid], w, devices.get(w.device_id) if w is not None else None))
    items = []
    for problem, winner, device in rows:
        items.append(
            ProblemRow(
                problem=problem_record(problem),
                device=device_record(device) if device is not None else None,
                winner=winner_record(winner, device.key, problem.key)
                if winner is not None
                else None,
            )
        )
    return Page(items=tuple(items), total=total, offset=offset, limit=limit)

"""Devices, problems, measurements and winners (private; import from :mod:`db.repository`)."""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Select, and_, bindparam, delete, func, or_, select
from sqlalchemy.orm import Session

from db._common import (
    check_page,
    dialect,
    finite,
    insert,
    json_object,
    text_field,
)
from db._convert import device_record, measurement_record, problem_record, winner_record
from db.errors import NotFoundError
from db.models import KEY_LEN, MEASUREMENT_STATUSES, Device, Measurement, Problem, Winner, utcnow
from db.records import (
    DeviceRecord,
    MeasurementRecord,
    Neighbor,
    Page,
    ProblemRecord,
    ProblemRow,
    WinnerChoice,
    WinnerRecord,
)
from db.rule import choose_winner

Rule = Callable[[Sequence[MeasurementRecord]], WinnerChoice | None]


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, not {value!r}")
    return value


def log_feature(x: float) -> float:
    """log2 of a shape extent; extents below 1 count as 1 (log 0)."""
    return math.log2(max(float(x), 1.0))


# --------------------------------------------------------------------------- devices


def upsert_device(
    s: Session,
    *,
    key: str,
    platform: str,
    device_kind: str,
    num_devices: int,
    num_processes: int,
    topology: str | None,
    jax_version: str,
    jaxlib_version: str,
) -> DeviceRecord:
    """Insert the device unless its ``key`` exists; return the stored row either way.

    Safe under concurrency (INSERT ... ON CONFLICT DO NOTHING, then SELECT). The key is the
    caller's hash of the fingerprint, so an existing row is never changed.
    """
    values = {
        "key": text_field(key, "key", max_len=KEY_LEN),
        "platform": text_field(platform, "platform", max_len=32),
        "device_kind": text_field(device_kind, "device_kind", max_len=128),
        "num_devices": _positive_int(num_devices, "num_devices"),
        "num_processes": _positive_int(num_processes, "num_processes"),
        "topology": text_field(topology, "topology", max_len=128, optional=True),
        "jax_version": text_field(jax_version, "jax_version", max_len=32),
        "jaxlib_version": text_field(jaxlib_version, "jaxlib_version", max_len=32),
        "created_at": utcnow(),
    }
    s.execute(insert(s, Device).values(**values).on_conflict_do_nothing(index_elements=["key"]))
    row = s.execute(
        select(Device).where(Device.key == key).execution_options(populate_existing=True)
    ).scalar_one()
    return device_record(row)


def get_device(s: Session, device_id: int) -> DeviceRecord | None:
    row = s.get(Device, device_id)
    return device_record(row) if row is not None else None


def get_device_by_key(s: Session, key: str) -> DeviceRecord | None:
    row = s.scalars(select(Device).where(Device.key == key)).one_or_none()
    return device_record(row) if row is not None else None


def list_devices(s: Session) -> list[DeviceRecord]:
    return [device_record(r) for r in s.scalars(select(Device).order_by(Device.id))]


# --------------------------------------------------------------------------- problems


def upsert_problem(
    s: Session,
    *,
    key: str,
    canonical: dict[str, Any],
    equation: str,
    pattern: str,
    dtype: str,
    mesh_size: int,
    m: float,
    n: float,
    k: float,
    b: float,
    flops: float,
    comm_bytes: float,
) -> ProblemRecord:
    """Insert the problem unless its ``key`` exists; return the stored row either way.

    ``canonical`` is ``autotuner.Problem``'s canonical dict, ``key`` its hash; ``pattern``
    e.g. ``"all_gather:lhs:free"``; ``mesh_size`` the size of the collective's axis;
    ``m, n, k, b`` (>= 0; ``b`` the batch) feed :func:`nearest_winners`.
    Safe under concurrency (INSERT ... ON CONFLICT DO NOTHING, then SELECT).
    """
    extents = {
        name: finite(v, name, minimum=0.0) for name, v in (("m", m), ("n", n), ("k", k), ("b", b))
    }
    values: dict[str, Any] = {
        "key": text_field(key, "key", max_len=KEY_LEN),
        "canonical": json_object(canonical, "canonical"),
        "equation": text_field(equation, "equation", max_len=256),
        "pattern": text_field(pattern, "pattern", max_len=64),
        "dtype": text_field(dtype, "dtype", max_len=32),
        "mesh_size": _positive_int(mesh_size, "mesh_size"),
        **extents,
        "flops": finite(flops, "flops", minimum=0.0),
        "comm_bytes": finite(comm_bytes, "comm_bytes", minimum=0.0),
        **{"l" + name: log_feature(v) for name, v in extents.items() if v is not None},
        "created_at": utcnow(),
    }
    s.execute(insert(s, Problem).values(**values).on_conflict_do_nothing(index_elements=["key"]))
    row = s.execute(
        select(Problem).where(Problem.key == key).execution_options(populate_existing=True)
    ).scalar_one()
    return problem_record(row)


def get_problem(s: Session, problem_id: int) -> ProblemRecord | None:
    row = s.get(Problem, problem_id)
    return problem_record(row) if row is not None else None


def get_problem_by_key(s: Session, key: str) -> ProblemRecord | None:
    row = s.scalars(select(Problem).where(Problem.key == key)).one_or_none()
    return problem_record(row) if row is not None else None


# --------------------------------------------------------------------------- measurements

_MEASUREMENT_FIELDS = frozenset(
    "strategy strategy_key status reason samples median_s iqr_s min_s n ratio ratio_lo "
    "ratio_hi compile_s memory run_id host created_at".split()
)


def _measurement_row(device_id: int, problem_id: int, i: int, item: Any) -> Measurement:
    where = f"items[{i}]"
    if not isinstance(item, dict):
        raise ValueError(f"{where} must be a dict, not {type(item).__name__}")
    unknown = set(item) - _MEASUREMENT_FIELDS
    if unknown:
        raise ValueError(f"{where} has unknown fields {sorted(unknown)}")
    strategy = json_object(item.get("strategy"), f"{where}.strategy")
    assert strategy is not None
    method = strategy.get("method")
    if not isinstance(method, str) or not method:
        raise ValueError(f'{where}.strategy needs a "method" string')
    status = item.get("status")
    if status not in MEASUREMENT_STATUSES:
        raise ValueError(f"{where}.status must be one of {MEASUREMENT_STATUSES}, not {status!r}")
    samples = item.get("samples", [])
    if not isinstance(samples, list | tuple):
        raise ValueError(f"{where}.samples must be a list of seconds")
    samples = [finite(x, f"{where}.samples[{j}]", minimum=0.0) for j, x in enumerate(samples)]
    n = item.get("n", len(samples))
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{where}.n must be an integer >= 0, not {n!r}")

    def opt(name: str) -> float | None:
        return finite(item.get(name), f"{where}.{name}", optional=True, minimum=0.0)

    median_s = opt("median_s")
    if status == "ok" and median_s is None:
        raise ValueError(f'{where}: an "ok" measurement needs median_s')
    created_at = item.get("created_at")
    if created_at is not None and not isinstance(created_at, datetime):
        raise ValueError(f"{where}.created_at must be a datetime")
    return Measurement(
        device_id=device_id,
        problem_id=problem_id,
        strategy=strategy,
        strategy_key=text_field(item.get("strategy_key"), f"{where}.strategy_key", max_len=256),
        method=text_field(method, f"{where}.strategy.method", max_len=64),
        status=status,
        reason=text_field(item.get("reason"), f"{where}.reason", max_len=100_000, optional=True),
        samples=samples,
        median_s=median_s,
        iqr_s=opt("iqr_s"),
        min_s=opt("min_s"),
        n=n,
        ratio=opt("ratio"),
        ratio_lo=opt("ratio_lo"),
        ratio_hi=opt("ratio_hi"),
        compile_s=opt("compile_s"),
        memory=json_object(item.get("memory"), f"{where}.memory", optional=True),
        run_id=text_field(item.get("run_id"), f"{where}.run_id", max_len=64, optional=True),
        host=text_field(item.get("host"), f"{where}.host", max_len=256, optional=True),
        created_at=created_at if created_at is not None else utcnow(),
    )


def record_measurements(
    s: Session, device_id: int, problem_id: int, items: Sequence[dict[str, Any]]
) -> list[MeasurementRecord]:
    """Store measurements (see :class:`db.records.MeasurementInput`) of one problem on one
    device; return them with their ids, in order. Validates every item before writing any.
    Does not recompute the winner (call :func:`recompute_winner` in the same transaction)."""
    rows = [_measurement_row(device_id, problem_id, i, item) for i, item in enumerate(items)]
    if not rows:
        return []
    if s.get(Device, device_id) is None:
        raise NotFoundError(f"device {device_id} does not exist")
    if s.get(Problem, problem_id) is None:
        raise NotFoundError(f"problem {problem_id} does not exist")
    s.add_all(rows)
    s.flush()
    return [measurement_record(r) for r in rows]


def list_measurements(
    s: Session, problem_id: int, device_id: int | None = None
) -> list[MeasurementRecord]:
    """Every measurement of a problem (on one device if given), oldest first."""
    stmt = select(Measurement).where(Measurement.problem_id == problem_id)
    if device_id is not None:
        stmt = stmt.where(Measurement.device_id == device_id)
    return [measurement_record(r) for r in s.scalars(stmt.order_by(Measurement.id))]


# --------------------------------------------------------------------------- winners


def recompute_winner(
    s: Session, device_id: int, problem_id: int, rule: Rule = choose_winner
) -> WinnerRecord | None:
    """Re-derive the winner of (device, problem) from its measurements and store it.

    Runs in the caller's transaction. On PostgreSQL it first takes a row lock on the problem
    (``SELECT ... FOR NO KEY UPDATE``, which does not block measurement inserts), so
    concurrent recomputations of the same problem run one after the other; on SQLite the
    transaction already holds the database's write lock (``BEGIN IMMEDIATE``). The write is
    an upsert on the (device, problem) unique constraint. Returns the stored winner, or
    ``None`` (and deletes any stored one) when ``rule`` finds none.
    Recompute several problems in one transaction in ascending ``problem_id`` order.
    """
    lock = select(Problem.key).where(Problem.id == problem_id)
    if dialect(s) == "postgresql":
        lock = lock.with_for_update(key_share=True)
    problem_key = s.execute(lock).scalar_one_or_none()
    if problem_key is None:
        raise NotFoundError(f"problem {problem_id} does not exist")
    device_key = s.execute(select(Device.key).where(Device.id == device_id)).scalar_one_or_none()
    if device_key is None:
        raise NotFoundError(f"device {device_id} does not exist")

    measurements = list_measurements(s, problem_id, device_id)
    choice = rule(measurements)
    pair = and_(Winner.device_id == device_id, Winner.problem_id == problem_id)
    if choice is None:
        s.execute(delete(Winner).where(pair).execution_options(synchronize_session=False))
        return None

    now = utcnow()
    values: dict[str, Any] = {
        "strategy": choice.strategy,
        "strategy_key": choice.strategy_key,
        "method": choice.method,
        "speedup": choice.speedup,
        "speedup_lo": choice.speedup_lo,
        "speedup_hi": choice.speedup_hi,
        "baseline_s": choice.baseline_s,
        "winner_s": choice.winner_s,
        "measurement_ids": list(choice.measurement_ids),
        "trials": choice.trials,
        "updated_at": now,
    }
    stmt = insert(s, Winner).values(
        device_id=device_id, problem_id=problem_id, created_at=now, **values
    )
    s.execute(stmt.on_conflict_do_update(index_elements=["device_id", "problem_id"], set_=values))
    row = s.execute(
        select(Winner).where(pair).execution_options(populate_existing=True)
    ).scalar_one()
    return winner_record(row, device_key, problem_key)


def _winner_select() -> Select[tuple[Winner, str, str]]:
    return (
        select(Winner, Device.key, Problem.key)
        .join(Device, Winner.device_id == Device.id)
        .join(Problem, Winner.problem_id == Problem.id)
    )


def get_winner(s: Session, device_key: str, problem_key: str) -> WinnerRecord | None:
    """The stored winner of a problem on a device, by their keys."""
    return get_winners(s, device_key, [problem_key]).get(problem_key)


@functools.cache
def _winners_by_keys() -> tuple[Select[Any], Select[Any]]:
    # Two steps, each an index search whatever the planner knows: problem ids by key, then
    # winners by (device id, problem id) on their unique index. As one join, SQLite without
    # statistics walks every winner of the device instead (milliseconds per row at 100k).
    ids = select(Problem.id, Problem.key).where(Problem.key.in_(bindparam("keys", expanding=True)))
    device_id = select(Device.id).where(Device.key == bindparam("device_key")).scalar_subquery()
    winners = select(*Winner.__table__.c).where(
        Winner.device_id == device_id, Winner.problem_id.in_(bindparam("ids", expanding=True)))
    return ids, winners


def get_winners(s: Session, device_key: str, problem_keys: Sequence[str]) -> dict[str, WinnerRecord]:
    """The stored winners of many problems on one device, by problem key: two queries per 500
    keys.

    This is the service's lookup path, so it is kept lean: statements built once, run on the
    session's connection, plain column rows rather than ORM entities (building mapped objects
    costs more than the queries)."""
    keys = list(dict.fromkeys(problem_keys))
    out: dict[str, WinnerRecord] = {}
    conn = s.connection()
    by_keys, winners = _winners_by_keys()
    for lo in range(0, len(keys), 500):
        key_of = {pid: pkey for pid, pkey in conn.execute(by_keys, {"keys": keys[lo: lo + 500]})}
        if not key_of:
            continue
        for row in conn.execute(winners, {"device_key": device_key, "ids": list(key_of)}):
            pkey = key_of[row.problem_id]
            out[pkey] = winner_record(row, device_key, pkey)
    return out


def list_winners(s: Session, device_key: str | None = None) -> list[WinnerRecord]:
    stmt = _winner_select()
    if device_key is not None:
        stmt = stmt.where(Device.key == device_key)
    return [winner_record(*r) for r in s.execute(stmt.order_by(Winner.id))]


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
    device_id = s.execute(select(Device.id).where(Device.key == device_key)).scalar_one_or_none()
    if device_id is None:
        return []
    target = {
        "lm": log_feature(finite(m, "m", minimum=0.0) or 0.0),
        "ln": log_feature(finite(n, "n", minimum=0.0) or 0.0),
        "lk": log_feature(finite(k, "k", minimum=0.0) or 0.0),
        "lb": log_feature(finite(b, "b", minimum=0.0) or 0.0),
    }
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


# --------------------------------------------------------------------------- listing

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

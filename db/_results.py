"""Measurements and the winners derived from them (private; import from :mod:`db.repository`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import and_, bindparam, delete, select
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from autotuner.rule import MEASUREMENT_SOURCES, reference_method
from db._changes import note_change
from db._common import check_value, check_values, dialect, insert, named_lock, utcnow
from db._convert import measurement_record, winner_record
from db.apply_rule import choose_winner
from db.errors import NotFoundError
from db.fields import fields_of
from db.records import (
    MEASUREMENT_INPUT_FIELDS,
    MeasurementRecord,
    WinnerChoice,
    WinnerRecord,
)
from db.tables import MEASUREMENT_STATUSES, Device, Measurement, Problem, Winner

Rule = Callable[[Sequence[MeasurementRecord], str], WinnerChoice | None]  # (measurements, reference)

_INPUT = fields_of(MeasurementRecord, MEASUREMENT_INPUT_FIELDS)
_METHOD = fields_of(MeasurementRecord, ("method",))["method"]
# what a rule's choice stores in the winner row: the fields WinnerChoice and WinnerRecord share
_CHOSEN = tuple(f.name for f in dataclasses.fields(WinnerChoice)
                if f.name in fields_of(WinnerRecord))


# --------------------------------------------------------------------------- measurements


def _measurement_row(device_id: int, problem_id: int, i: int, item: Any, token_id: int | None = None) -> Measurement:
    where = f"items[{i}]"
    if not isinstance(item, dict):
        raise ValueError(f"{where} must be a dict, not {type(item).__name__}")
    samples = item.get("samples") or []
    defaults = {"samples": [], "n": len(samples) if isinstance(samples, list | tuple) else 0,
                "created_at": utcnow(), "source": MEASUREMENT_SOURCES[0]}
    values = check_values(_INPUT, {**defaults, **{k: v for k, v in item.items() if v is not None}},
                          where)
    method = values["strategy"].get("method")
    if not isinstance(method, str) or not method:
        raise ValueError(f'{where}.strategy needs a "method" string')
    check_value(_METHOD, method, f"{where}.strategy.method")
    if values["source"] not in MEASUREMENT_SOURCES:
        raise ValueError(f"{where}.source must be one of {MEASUREMENT_SOURCES}, not {values['source']!r}")
    if values["status"] not in MEASUREMENT_STATUSES:
        raise ValueError(f"{where}.status must be one of {MEASUREMENT_STATUSES}, "
                         f"not {values['status']!r}")
    if values["status"] == "ok" and values["median_s"] is None:
        raise ValueError(f'{where}: an "ok" measurement needs median_s')
    return Measurement(device_id=device_id, problem_id=problem_id, method=method, token_id=token_id, **values)


def _identity(run_id: str | None, strategy_key: str, status: str, reason: str | None,
              samples: Sequence[float]) -> tuple[Any, ...]:
    return (run_id, strategy_key, status, reason, tuple(float(x) for x in samples))


def _replayed(s: Session, device_id: int, problem_id: int, rows: list[Measurement]) -> list[bool]:
    """Which rows repeat a stored measurement of their run (its ``run_id``, strategy, status,
    reason and every sample the same): an upload sent again because its answer was lost."""
    runs = {r.run_id for r in rows if r.run_id is not None}
    if not runs:
        return [False] * len(rows)
    # a replay sent while the first upload is still being stored (its answer timed out) waits for
    # that transaction, then reads what it stored
    named_lock(s, f"measurements:{device_id}:{problem_id}")
    m = Measurement
    stored = {_identity(*t) for t in s.execute(
        select(m.run_id, m.strategy_key, m.status, m.reason, m.samples)
        .where(m.device_id == device_id, m.problem_id == problem_id, m.run_id.in_(runs)))}
    return [r.run_id is not None and _identity(r.run_id, r.strategy_key, r.status, r.reason, r.samples) in stored
            for r in rows]


def record_measurements(
    s: Session, device_id: int, problem_id: int, items: Sequence[dict[str, Any]], token_id: int | None = None
) -> list[MeasurementRecord]:
    """Store measurements (see :class:`db.records.MeasurementInput`) of one problem on one
    device, uploaded with the stored token ``token_id`` (None: a settings token or a direct
    write); return the ones stored with their ids, in order. An item without a ``source`` was
    measured by a tuning run (``tuned``). An item that repeats a stored measurement of the same
    run (``run_id``, strategy, status, reason and samples) is a replay of an upload whose answer
    was lost, and is not stored twice (items without a ``run_id`` are always stored). Validates
    every item before writing any. Does not recompute the winner (call :func:`recompute_winner`
    in the same transaction)."""
    rows = [_measurement_row(device_id, problem_id, i, item, token_id) for i, item in enumerate(items)]
    if not rows:
        return []
    if s.get(Device, device_id) is None:
        raise NotFoundError(f"device {device_id} does not exist")
    if s.get(Problem, problem_id) is None:
        raise NotFoundError(f"problem {problem_id} does not exist")
    rows = [r for r, again in zip(rows, _replayed(s, device_id, problem_id, rows), strict=True) if not again]
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
    ``None`` (and deletes any stored one) when ``rule`` finds none. The rule gets the device's
    reference method (``baseline``, or ``plain`` on TPU: `autotuner.rule.reference_method`).
    Recompute several problems in one transaction in ascending ``problem_id`` order.
    """
    lock = select(Problem.key).where(Problem.id == problem_id)
    if dialect(s) == "postgresql":
        lock = lock.with_for_update(key_share=True)
    problem_key = s.execute(lock).scalar_one_or_none()
    if problem_key is None:
        raise NotFoundError(f"problem {problem_id} does not exist")
    device = s.execute(select(Device.key, Device.platform).where(Device.id == device_id)).one_or_none()
    if device is None:
        raise NotFoundError(f"device {device_id} does not exist")
    device_key = device.key

    measurements = list_measurements(s, problem_id, device_id)
    choice = rule(measurements, reference_method(device.platform))
    pair = and_(Winner.device_id == device_id, Winner.problem_id == problem_id)
    note_change(s, device_key, problem_key)  # the caches of every process learn it (db._changes)
    if choice is None:
        s.execute(delete(Winner).where(pair).execution_options(synchronize_session=False))
        return None

    now = utcnow()
    values: dict[str, Any] = {name: getattr(choice, name) for name in _CHOSEN}
    values.update(measurement_ids=list(choice.measurement_ids), updated_at=now)
    stmt = insert(s, Winner).values(
        device_id=device_id, problem_id=problem_id, created_at=now, **values
    )
    s.execute(stmt.on_conflict_do_update(index_elements=["device_id", "problem_id"], set_=values))
    row = s.execute(
        select(Winner).where(pair).execution_options(populate_existing=True)
    ).scalar_one()
    return winner_record(row, device_key, problem_key)


def get_winner(s: Session, device_key: str, problem_key: str) -> WinnerRecord | None:
    """The stored winner of a problem on a device, by their keys."""
    return get_winners(s, device_key, [problem_key]).get(problem_key)


# The lookup path's two statements, built once. Two steps, each an index search whatever the
# planner knows: problem ids by key, then winners by (device id, problem id) on their unique
# index. As one join, SQLite without statistics walks every winner of the device instead
# (milliseconds per row at 100k).
_IDS_BY_KEYS = select(Problem.id, Problem.key).where(
    Problem.key.in_(bindparam("keys", expanding=True)))
_WINNERS_BY_IDS = select(*Winner.__table__.c).where(
    Winner.device_id == select(Device.id).where(Device.key == bindparam("device_key"))
    .scalar_subquery(),
    Winner.problem_id.in_(bindparam("ids", expanding=True)))


def get_winners(s: Session | Connection, device_key: str, problem_keys: Sequence[str]
                ) -> dict[str, WinnerRecord]:
    """The stored winners of many problems on one device, by problem key: two queries per 500
    keys.

    This is the service's lookup path, so it is kept lean: statements built once, run on the
    session's connection (or the connection given: ``Database.reader``), plain column rows
    rather than ORM entities (building mapped objects costs more than the queries)."""
    keys = list(dict.fromkeys(problem_keys))
    out: dict[str, WinnerRecord] = {}
    conn = s.connection() if isinstance(s, Session) else s
    for lo in range(0, len(keys), 500):
        key_of = dict(conn.execute(_IDS_BY_KEYS, {"keys": keys[lo: lo + 500]}).all())
        if not key_of:
            continue
        for row in conn.execute(_WINNERS_BY_IDS, {"device_key": device_key, "ids": list(key_of)}):
            pkey = key_of[row.problem_id]
            out[pkey] = winner_record(row, device_key, pkey)
    return out


def list_winners(s: Session, device_key: str | None = None) -> list[WinnerRecord]:
    """Every stored winner (of one device if given), by id."""
    stmt = (
        select(Winner, Device.key, Problem.key)
        .join(Device, Winner.device_id == Device.id)
        .join(Problem, Winner.problem_id == Problem.id)
    )
    if device_key is not None:
        stmt = stmt.where(Device.key == device_key)
    return [winner_record(*r) for r in s.execute(stmt.order_by(Winner.id))]

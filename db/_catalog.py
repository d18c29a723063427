"""Devices and problems: what measurements are of (private; import from :mod:`db.repository`).

Both are written by their key (the caller's hash of the fingerprint or of the canonical
problem), once: a stored row never changes.
"""

from __future__ import annotations

import math
from typing import Any, TypeVar

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from db._common import check_values, insert, utcnow
from db._convert import device_record, problem_record
from db.fields import fields_of
from db.records import DeviceRecord, ProblemRecord
from db.tables import Base, Device, Problem

M = TypeVar("M", bound=Base)

_DEVICE = fields_of(DeviceRecord, skip=("id", "created_at"))
_PROBLEM = fields_of(ProblemRecord, skip=("id", "created_at"))
EXTENTS = ("m", "n", "k", "b")


def log_feature(x: float) -> float:
    """log2 of a shape extent; extents below 1 count as 1 (log 0)."""
    return math.log2(max(float(x), 1.0))


def _upsert_by_key(s: Session, model: type[M], values: dict[str, Any]) -> M:
    """Insert the row unless its ``key`` exists (INSERT ... ON CONFLICT DO NOTHING, safe under
    concurrency), then return the stored row either way."""
    stmt = insert(s, model).values(**values, created_at=utcnow())
    s.execute(stmt.on_conflict_do_nothing(index_elements=["key"]))
    return s.execute(  # type: ignore[no-any-return]
        select(model).where(model.key == values["key"])  # type: ignore[attr-defined]
        .execution_options(populate_existing=True)
    ).scalar_one()


def _by_id(s: Session, model: type[Base], convert: Any, row_id: int) -> Any:
    row = s.get(model, row_id)
    return convert(row) if row is not None else None


def _by_key(s: Session, model: type[Base], convert: Any, key: str) -> Any:
    row = s.scalars(select(model).where(model.key == key)).one_or_none()  # type: ignore[attr-defined]
    return convert(row) if row is not None else None


# --------------------------------------------------------------------------- devices


def upsert_device(s: Session, **values: Any) -> DeviceRecord:
    """Store a device unless its ``key`` exists; return the stored row either way.

    ``values`` are the fields of :class:`~db.records.DeviceRecord` but ``id`` and
    ``created_at`` (``key``, ``platform``, ``device_kind``, ``num_devices``, ...: what
    ``autotuner.Device`` holds, and its key). The key is the caller's hash of the
    fingerprint, so an existing row is never changed.
    """
    return device_record(_upsert_by_key(s, Device, check_values(_DEVICE, values)))


def get_device(s: Session, device_id: int) -> DeviceRecord | None:
    return _by_id(s, Device, device_record, device_id)  # type: ignore[no-any-return]


def get_device_by_key(s: Session, key: str) -> DeviceRecord | None:
    return _by_key(s, Device, device_record, key)  # type: ignore[no-any-return]


def list_devices(s: Session) -> list[DeviceRecord]:
    return [device_record(r) for r in s.scalars(select(Device).order_by(Device.id))]


# --------------------------------------------------------------------------- problems


def upsert_problem(s: Session, **values: Any) -> ProblemRecord:
    """Store a problem unless its ``key`` exists; return the stored row either way.

    ``values`` are the fields of :class:`~db.records.ProblemRecord` but ``id`` and
    ``created_at``; ``m, n, k, b`` feed :func:`~db.repository.nearest_winners`. ``name``
    (optional) labels a stored problem that has none yet; a stored name never changes.
    """
    checked = check_values(_PROBLEM, values)
    checked.update({"l" + e: log_feature(checked[e]) for e in EXTENTS})
    row = _upsert_by_key(s, Problem, checked)
    if row.name is None and checked["name"] is not None:
        s.execute(update(Problem).where(Problem.id == row.id, Problem.name.is_(None)).values(name=checked["name"]))
        s.refresh(row)
    return problem_record(row)


def get_problem(s: Session, problem_id: int) -> ProblemRecord | None:
    return _by_id(s, Problem, problem_record, problem_id)  # type: ignore[no-any-return]


def get_problem_by_key(s: Session, key: str) -> ProblemRecord | None:
    return _by_key(s, Problem, problem_record, key)  # type: ignore[no-any-return]

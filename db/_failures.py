"""Problems that could not be tuned on a device (private; import from :mod:`db.repository`)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from db._common import check_values, named_lock, now_utc, text_field
from db._convert import failure_record
from db.errors import NotFoundError
from db.fields import fields_of
from db.records import FailureRecord
from db.tables import KEY_LEN, Device, Failure, Problem

_WRITTEN = fields_of(FailureRecord, skip=("id", "device_id", "problem_id", "device_key", "problem_key",
                                          "created_at"))


def record_failure(s: Session, device_id: int, problem_id: int, *, created_at: datetime | None = None,
                   **values: Any) -> FailureRecord:
    """Store that problem ``problem_id`` could not be tuned on device ``device_id``: ``error`` (why),
    optionally ``name`` (the run's label of the problem), ``run_id`` and ``host``. It replaces an
    earlier failure of the same pair. Raises :class:`NotFoundError` if either row does not exist."""
    values = check_values(_WRITTEN, values)
    device, problem = s.get(Device, device_id), s.get(Problem, problem_id)
    if device is None:
        raise NotFoundError(f"device {device_id} does not exist")
    if problem is None:
        raise NotFoundError(f"problem {problem_id} does not exist")
    named_lock(s, f"failure:{device_id}:{problem_id}")   # two writers at once: the second replaces the first's
    s.execute(delete(Failure).where(Failure.device_id == device_id, Failure.problem_id == problem_id))
    row = Failure(device_id=device_id, problem_id=problem_id, **values, created_at=now_utc(created_at))
    s.add(row)
    s.flush()
    return failure_record(row, device.key, problem.key)


def clear_failure(s: Session, device_id: int, problem_id: int) -> bool:
    """Forget the failure of a (device, problem), e.g. once it is tuned; True if there was one."""
    res = s.execute(delete(Failure).where(Failure.device_id == device_id, Failure.problem_id == problem_id))
    return bool(res.rowcount)  # type: ignore[attr-defined]


def list_failures(s: Session, device_key: str | None = None, *, limit: int = 100) -> list[FailureRecord]:
    """Failed problems, newest first, of one device (``device_key``) or of all."""
    if not isinstance(limit, int) or not 1 <= limit <= 1000:
        raise ValueError(f"limit must be an integer in 1..1000, not {limit!r}")
    q = (select(Failure, Device.key, Problem.key).join(Device, Device.id == Failure.device_id)
         .join(Problem, Problem.id == Failure.problem_id))
    if device_key is not None:
        text_field(device_key, "device_key", max_len=KEY_LEN)
        q = q.where(Device.key == device_key)
    rows = s.execute(q.order_by(Failure.created_at.desc(), Failure.id.desc()).limit(limit)).all()
    return [failure_record(f, dk, pk) for f, dk, pk in rows]

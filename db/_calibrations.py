"""Cost-model calibrations per device (private; import from :mod:`db.repository`)."""

from __future__ import annotations

import copy
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from db._changes import note_change
from db._common import check_values, now_utc, text_field
from db._convert import calibration_record
from db.errors import NotFoundError
from db.fields import fields_of
from db.records import CalibrationRecord
from db.tables import KEY_LEN, Calibration, Device

_WRITTEN = fields_of(CalibrationRecord, skip=("id", "device_id", "device_key", "created_at"))


def add_calibration(s: Session, device_id: int, *, created_at: datetime | None = None,
                    **values: Any) -> CalibrationRecord:
    """Store a calibration of device ``device_id``: the fields of :class:`CalibrationRecord`
    that are not ids or keys, as keywords (``model``, e.g. ``"costmodel-v1"``; ``params``;
    optionally ``raw``, the measurements it was fitted on; ``host``). It becomes the one
    :func:`get_calibration` returns; earlier ones stay. ``params`` and ``raw`` are JSON
    objects, opaque here. Raises :class:`NotFoundError` if the device does not exist.
    """
    values = check_values(_WRITTEN, values)
    device = s.get(Device, device_id)
    if device is None:
        raise NotFoundError(f"device {device_id} does not exist")
    row = Calibration(device_id=device_id, **copy.deepcopy(values), created_at=now_utc(created_at))
    s.add(row)
    s.flush()
    note_change(s, device.key)  # the model's answers for this device may change
    return calibration_record(row, device.key)


def get_calibration(s: Session, device_key: str, *, model: str | None = None) -> CalibrationRecord | None:
    """The newest calibration of the device with ``device_key`` (of ``model``, if given), or
    ``None`` (no such device, or never calibrated)."""
    text_field(device_key, "device_key", max_len=KEY_LEN)  # a key that cannot exist: an error
    q = (select(Calibration, Device.key).join(Device, Device.id == Calibration.device_id)
         .where(Device.key == device_key))
    if model is not None:
        q = q.where(Calibration.model == model)
    row = s.execute(q.order_by(Calibration.created_at.desc(), Calibration.id.desc()).limit(1)).first()
    return None if row is None else calibration_record(row[0], row[1])


def list_calibrations(s: Session, device_key: str | None = None, *, model: str | None = None,
                      limit: int = 100) -> list[CalibrationRecord]:
    """Calibrations, newest first, of one device (``device_key``) or of all."""
    if not isinstance(limit, int) or not 1 <= limit <= 1000:
        raise ValueError(f"limit must be an integer in 1..1000, not {limit!r}")
    q = select(Calibration, Device.key).join(Device, Device.id == Calibration.device_id)
    if device_key is not None:
        q = q.where(Device.key == device_key)
    if model is not None:
        q = q.where(Calibration.model == model)
    rows = s.execute(q.order_by(Calibration.created_at.desc(), Calibration.id.desc()).limit(limit)).all()
    return [calibration_record(c, k) for c, k in rows]

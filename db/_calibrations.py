"""Cost-model calibrations per device (private; import from :mod:`db.repository`)."""

from __future__ import annotations

import copy
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from db._common import json_object, now_utc, text_field
from db.errors import NotFoundError
from db.models import KEY_LEN, Calibration, Device
from db.records import CalibrationRecord

MODEL_LEN = 64


def _record(row: Calibration, device_key: str) -> CalibrationRecord:
    return CalibrationRecord(
        id=row.id,
        device_id=row.device_id,
        device_key=device_key,
        model=row.model,
        params=copy.deepcopy(row.params),
        raw=copy.deepcopy(row.raw),
        host=row.host,
        created_at=row.created_at,
    )


def add_calibration(
    s: Session,
    device_id: int,
    *,
    model: str,
    params: dict[str, Any],
    raw: dict[str, Any] | None = None,
    host: str | None = None,
    created_at: datetime | None = None,
) -> CalibrationRecord:
    """Store a calibration of device ``device_id`` for cost model ``model`` (e.g.
    ``"costmodel-v1"``); it becomes the one :func:`get_calibration` returns. Earlier ones stay.

    ``params`` (and ``raw``, the measurements it was fitted on) are JSON objects, opaque here.
    Raises :class:`NotFoundError` if the device does not exist.
    """
    text_field(model, "model", max_len=MODEL_LEN)
    json_object(params, "params")
    json_object(raw, "raw", optional=True)
    text_field(host, "host", max_len=256, optional=True)
    device = s.get(Device, device_id)
    if device is None:
        raise NotFoundError(f"device {device_id} does not exist")
    row = Calibration(device_id=device_id, model=model, params=copy.deepcopy(params),
                      raw=copy.deepcopy(raw), host=host, created_at=now_utc(created_at))
    s.add(row)
    s.flush()
    return _record(row, device.key)


def get_calibration(s: Session, device_key: str, *, model: str | None = None) -> CalibrationRecord | None:
    """The newest calibration of the device with ``device_key`` (of ``model``, if given), or
    ``None`` (no such device, or never calibrated)."""
    text_field(device_key, "device_key", max_len=KEY_LEN)
    q = (select(Calibration, Device.key).join(Device, Device.id == Calibration.device_id)
         .where(Device.key == device_key))
    if model is not None:
        q = q.where(Calibration.model == model)
    row = s.execute(q.order_by(Calibration.created_at.desc(), Calibration.id.desc()).limit(1)).first()
    return None if row is None else _record(row[0], row[1])


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
    return [_record(c, k) for c, k in rows]

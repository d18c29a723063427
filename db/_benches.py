"""Whole-program benchmarks, one row per `autotuner bench-model` run (private; import from
:mod:`db.repository`)."""

from __future__ import annotations

import copy
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from db._common import check_values, now_utc, text_field
from db._convert import model_bench_record
from db.errors import NotFoundError
from db.fields import fields_of
from db.records import ModelBenchRecord
from db.tables import KEY_LEN, Device, ModelBench

_WRITTEN = fields_of(ModelBenchRecord, skip=("id", "device_id", "device_key", "created_at"))


def record_model_bench(s: Session, device_id: int, *, created_at: datetime | None = None,
                       **values: Any) -> ModelBenchRecord:
    """Store one bench-model run on device ``device_id``: the fields of
    :class:`ModelBenchRecord` that are not ids or keys, as keywords (optional ones may be left
    out). Raises :class:`NotFoundError` if the device does not exist."""
    values = check_values(_WRITTEN, values)
    device = s.get(Device, device_id)
    if device is None:
        raise NotFoundError(f"device {device_id} does not exist")
    row = ModelBench(device_id=device_id, **copy.deepcopy(values), created_at=now_utc(created_at))
    s.add(row)
    s.flush()
    return model_bench_record(row, device.key)


def get_model_bench(s: Session, bench_id: int) -> ModelBenchRecord | None:
    """The bench-model run with id ``bench_id``, or ``None``."""
    row = s.execute(select(ModelBench, Device.key).join(Device, Device.id == ModelBench.device_id)
                    .where(ModelBench.id == bench_id)).first()
    return None if row is None else model_bench_record(row[0], row[1])


def list_model_benches(s: Session, device_key: str | None = None, *, program: str | None = None,
                       limit: int = 100) -> list[ModelBenchRecord]:
    """Bench-model runs, newest first, of one device (``device_key``) and/or one ``program``
    (``MODULE:FACTORY``), or of all."""
    if not isinstance(limit, int) or not 1 <= limit <= 1000:
        raise ValueError(f"limit must be an integer in 1..1000, not {limit!r}")
    q = select(ModelBench, Device.key).join(Device, Device.id == ModelBench.device_id)
    if device_key is not None:
        text_field(device_key, "device_key", max_len=KEY_LEN)
        q = q.where(Device.key == device_key)
    if program is not None:
        q = q.where(ModelBench.program == program)
    rows = s.execute(q.order_by(ModelBench.created_at.desc(), ModelBench.id.desc()).limit(limit)).all()
    return [model_bench_record(b, k) for b, k in rows]

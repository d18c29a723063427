"""In-program evidence: what a whole program's step said about each problem's choice on one
device (`autotuner tune-model`'s refinement; private, import from :mod:`db.repository`)."""

from __future__ import annotations

import copy
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from db._changes import note_change
from db._common import check_values, now_utc, text_field
from db._convert import evidence_record
from db.errors import NotFoundError
from db.fields import fields_of
from db.records import EvidenceRecord
from db.tables import KEY_LEN, Device, StepEvidence

_WRITTEN = fields_of(EvidenceRecord, skip=("id", "device_id", "device_key", "created_at"))


def record_evidence(s: Session, device_id: int, *, created_at: datetime | None = None,
                    **values: Any) -> EvidenceRecord:
    """Store one problem's in-program evidence on device ``device_id``: the fields of
    :class:`EvidenceRecord` that are not ids or keys, as keywords. It becomes the evidence
    :func:`get_evidence` returns for its (program, problem); earlier rows stay. Raises
    :class:`NotFoundError` if the device does not exist."""
    values = check_values(_WRITTEN, values)
    device = s.get(Device, device_id)
    if device is None:
        raise NotFoundError(f"device {device_id} does not exist")
    row = StepEvidence(device_id=device_id, **copy.deepcopy(values), created_at=now_utc(created_at))
    s.add(row)
    s.flush()
    note_change(s, device.key, values["problem_key"])   # cached answers of this problem may change
    return evidence_record(row, device.key)


def get_evidence(s: Session, device_key: str, program_key: str | None = None) -> list[EvidenceRecord]:
    """The evidence in use on the device with ``device_key``: the newest row of each (program,
    problem), of one program if ``program_key`` is given; ordered by program, then oldest first."""
    text_field(device_key, "device_key", max_len=KEY_LEN)
    if program_key is not None:
        text_field(program_key, "program_key", max_len=64)
    newest = (select(func.max(StepEvidence.id)).join(Device, Device.id == StepEvidence.device_id)
              .where(Device.key == device_key))
    if program_key is not None:
        newest = newest.where(StepEvidence.program_key == program_key)
    newest = newest.group_by(StepEvidence.program_key, StepEvidence.problem_key)
    rows = s.execute(select(StepEvidence, Device.key).join(Device, Device.id == StepEvidence.device_id)
                     .where(StepEvidence.id.in_(newest))
                     .order_by(StepEvidence.program_key, StepEvidence.id)).all()
    return [evidence_record(e, k) for e, k in rows]


def list_evidence(s: Session, *, limit: int = 1000) -> list[EvidenceRecord]:
    """The evidence in use on every device (the newest row of each (device, program, problem)),
    for a snapshot; at most ``limit`` rows, newest first."""
    if not isinstance(limit, int) or not 1 <= limit <= 100_000:
        raise ValueError(f"limit must be an integer in 1..100000, not {limit!r}")
    newest = select(func.max(StepEvidence.id)).group_by(
        StepEvidence.device_id, StepEvidence.program_key, StepEvidence.problem_key)
    rows = s.execute(select(StepEvidence, Device.key).join(Device, Device.id == StepEvidence.device_id)
                     .where(StepEvidence.id.in_(newest)).order_by(StepEvidence.id.desc()).limit(limit)).all()
    return [evidence_record(e, k) for e, k in rows]

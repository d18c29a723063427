"""The snapshot format, in one place: the stored winners as JSON, for a client that answers
without asking the service.

A snapshot is one JSON object::

    {"format": "autotuner-snapshot", "version": 1, "exported_at": TIME,
     "devices": [DEVICE, ...],     # each the device's key and fingerprint (`DEVICE_FIELDS`)
     "entries": [ENTRY, ...],      # one stored winner each (`Entry`)
     "evidence": [EVIDENCE, ...]}  # in-program evidence in use (`evidence_json`; optional)

The service serves it (``GET /v1/snapshot``: its response models are derived from `Entry`),
`autotuner plan/bench-model --db` builds it from the database (`document`), and
``Client(offline=FILE)`` reads it (`load`). A lookup answer (:class:`autotuner.answer.Answer`,
and its JSON: the client's disk cache lines) carries an entry's fields in the same JSON form
(`autotuner.answer.time_json`, `time_of`; `confidence_of`); `entry_answer` and `entry_json` convert an entry to
an Answer and back. Imports no db, web or optuna code.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from autotuner.answer import Answer, time_json
from autotuner.device import Device, DeviceError
from autotuner.errors import AutotunerError
from autotuner.files import write_atomic

FORMAT = "autotuner-snapshot"
VERSION = 1
# a device as stored and as a snapshot lists it: its key, then its fingerprint
DEVICE_FIELDS = ("key", *(f.name for f in fields(Device)))


class SnapshotError(AutotunerError, ValueError):
    """A file or document that is not a snapshot of this version, or an invalid part of one."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One stored winner of a snapshot, its fields in their JSON order. ``confidence`` is the
    speedup's interval where one was measured, ``record_id`` the winner record's id,
    ``measured_at`` when it last changed.

    Not an :class:`Answer`: this is the file format (and the service's ``SnapshotEntry`` schema
    is derived from these fields and types), which stores the strategy as its JSON with its
    ``strategy_key`` and no ``source``, ``origin``, ``distance`` or ``neighbor_key`` (a snapshot
    holds exact winners only; the reader says where they came from). An entry becomes an
    Answer in one place, `entry_answer`, and an Answer an entry in `entry_json`."""

    device_key: str
    problem_key: str
    strategy: dict[str, Any]
    strategy_key: str
    speedup: float
    confidence: tuple[float, float] | None
    record_id: int
    measured_at: datetime
    trials: int
    traffic_speedup: float | None = None   # the winner's split by its serial control (absent in older files)

    @classmethod
    def of(cls, winner: Any) -> Entry:
        """The entry of a stored winner (a ``db.WinnerRecord``, read by attribute)."""
        return cls(device_key=winner.device_key, problem_key=winner.problem_key, **evidence(winner))

    def to_json(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        return {**d, "confidence": list(self.confidence) if self.confidence else None,
                "measured_at": time_json(self.measured_at)}


def evidence(winner: Any) -> dict[str, Any]:
    """What an answer taken from a stored winner says about it: the fields of its `Entry` but
    the two keys (``measured_at`` a datetime, ``confidence`` a tuple or None)."""
    lo, hi = winner.speedup_lo, winner.speedup_hi
    return {"strategy": winner.strategy, "strategy_key": winner.strategy_key, "speedup": winner.speedup,
            "confidence": (lo, hi) if lo is not None and hi is not None else None,
            "record_id": winner.id, "measured_at": winner.updated_at, "trials": winner.trials,
            "traffic_speedup": winner.traffic_speedup}


def confidence_of(value: Any) -> tuple[float, float] | None:
    return (float(value[0]), float(value[1])) if value else None


def device_values(device: Device) -> dict[str, Any]:
    """The device as stored (the database's device row) and as a snapshot lists it."""
    return {"key": device.key, **device.to_dict()}


def device_of(item: Any) -> Device:
    """The device a snapshot lists; SnapshotError unless a fingerprint whose key it matches."""
    try:
        device = Device.from_dict({k: item[k] for k in DEVICE_FIELDS[1:]})
    except (KeyError, TypeError, DeviceError) as e:
        key = item.get("key") if isinstance(item, dict) else item
        raise SnapshotError(f"device {key} is not a device fingerprint: {e}") from None
    if device.key != item.get("key"):
        raise SnapshotError(f"device {item.get('key')} does not match its own fingerprint")
    return device


def document(devices: list[dict[str, Any]], entries: list[dict[str, Any]],
             exported_at: datetime | None = None, evidence: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A snapshot of `devices`, `entries` (`Entry.to_json`) and `evidence` (`evidence_json`),
    exported now by default."""
    return {"format": FORMAT, "version": VERSION, "exported_at": time_json(exported_at or datetime.now(UTC)),
            "devices": devices, "entries": entries, "evidence": evidence or []}


EVIDENCE_FIELDS = ("device_key", "program_key", "problem_key", "strategy", "strategy_key", "previous",
                   "previous_key", "speedup", "confidence", "reps", "measured_at")


def evidence_json(rec: Any) -> dict[str, Any]:
    """One stored in-program evidence (a ``db.EvidenceRecord``, read by attribute) as a snapshot
    and the service's /v1/evidence list it."""
    lo, hi = rec.speedup_lo, rec.speedup_hi
    return {"device_key": rec.device_key, "program_key": rec.program_key, "problem_key": rec.problem_key,
            "strategy": rec.strategy, "strategy_key": rec.strategy_key, "previous": rec.previous,
            "previous_key": rec.previous_key, "speedup": rec.speedup,
            "confidence": [lo, hi] if lo is not None and hi is not None else None, "reps": rec.reps,
            "measured_at": time_json(rec.created_at)}


def evidence_answers(items: Any, device_key: str, program_key: str) -> dict[str, dict[str, Any]]:
    """The evidence `overlap` reads (problem key -> strategy, previous as Strategies, speedup,
    confidence) from `evidence_json` items of this device and program; items that do not parse
    are left out."""
    from autotuner.strategy import Strategy

    out: dict[str, dict[str, Any]] = {}
    for e in items if isinstance(items, list) else []:
        try:
            if e["device_key"] != device_key or e["program_key"] != program_key:
                continue
            sp, ci = e.get("speedup"), e.get("confidence")
            out[str(e["problem_key"])] = {
                "strategy": Strategy.from_dict(e["strategy"]), "previous": Strategy.from_dict(e["previous"]),
                "speedup": float(sp) if isinstance(sp, int | float) else None,
                "confidence": (float(ci[0]), float(ci[1])) if isinstance(ci, list) and len(ci) == 2 else None}
        except (KeyError, TypeError, ValueError, IndexError):
            continue
    return out


def check(doc: Any, where: str) -> dict[str, Any]:
    """`doc` if it is a snapshot of this version, else SnapshotError naming `where`."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise SnapshotError(f"{where} is not an autotuner snapshot (expected format {FORMAT!r})")
    if doc.get("version") != VERSION:
        raise SnapshotError(f"{where}: snapshot version {doc.get('version')!r} is not supported "
                            f"(need {VERSION})")
    return doc


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A snapshot file's document (see `check`); SnapshotError if it cannot be read."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise SnapshotError(f"cannot read the snapshot {p}: {e}") from None
    return check(doc, str(p))


def entry_answer(item: Any, source: str) -> Answer:
    """A snapshot file's entry (its JSON, `Entry.to_json`'s form) as the Answer it gives, from
    ``source`` (`autotuner.rule.exact_source`), origin ``snapshot``. Raises ValueError,
    StrategyError, KeyError or TypeError for an entry that is not one."""
    return Answer.from_json({**item, "source": source}, "snapshot")


def entry_json(answer: Answer) -> dict[str, Any]:
    """The snapshot entry (`Entry.to_json`'s form) of a winner `answer`: no record (id 0), a
    speedup of 1.0 and 0 trials where the answer knows none."""
    return {"device_key": answer.device_key, "problem_key": answer.problem_key,
            "strategy": answer.strategy.to_dict(), "strategy_key": answer.strategy.key,
            "speedup": answer.speedup if answer.speedup is not None else 1.0,
            "confidence": list(answer.confidence) if answer.confidence else None, "record_id": 0,
            "measured_at": time_json(answer.measured_at), "trials": answer.trials or 0,
            "traffic_speedup": answer.traffic_speedup}


def put_entry(path: str | os.PathLike[str], device: Device, answer: Answer) -> None:
    """Add (or replace) the winner `answer` in the snapshot file at `path` (`entry_json`),
    listing `device` if it is not yet; the file is rewritten atomically. Raises SnapshotError."""
    doc = load(path)
    entry = entry_json(answer)
    pair = (entry["device_key"], entry["problem_key"])
    entries = [e for e in doc.get("entries") or []
               if not isinstance(e, dict) or (e.get("device_key"), e.get("problem_key")) != pair]
    doc["entries"] = [*entries, entry]
    devices = doc.get("devices") or []
    if not any(isinstance(d, dict) and d.get("key") == pair[0] for d in devices):
        doc["devices"] = [*devices, {"key": device.key, **device.to_dict()}]
    target = Path(path)
    try:
        write_atomic(target, json.dumps(doc))
    except OSError as e:
        raise SnapshotError(f"cannot write the snapshot {target}: {e}") from None

"""GET /v1/devices and GET /v1/snapshot: the stored winners, for offline clients."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter

from autotuner.snapshot import Entry, evidence_json
from db import repository as repo
from service.deps import ReadAuth, ReadSessionDep
from service.routes._common import READ, responses, text_query
from service.schemas import DeviceOut, Snapshot, SnapshotEntry

router = APIRouter(tags=["snapshot"])


@router.get("/v1/devices", response_model=list[DeviceOut], responses=responses(*READ))
def list_devices(_: ReadAuth, s: ReadSessionDep) -> list[DeviceOut]:
    """Every device fingerprint with measurements."""
    return [DeviceOut.of(d) for d in repo.list_devices(s)]


@router.get("/v1/snapshot", response_model=Snapshot, responses=responses(*READ))
def snapshot(
    _: ReadAuth,
    s: ReadSessionDep,
    device_key: Annotated[str | None, text_query("only this device key (default: all)", 128)] = None,
) -> Snapshot:
    """Every stored winner (of one device, or all), and the in-program evidence in use, for
    `Client(offline="snapshot.json")`."""
    exported_at = datetime.now(UTC)
    devices = [d for d in repo.list_devices(s) if device_key is None or d.key == device_key]
    entries = [SnapshotEntry.of(Entry.of(w)) for w in repo.list_winners(s, device_key)]
    evidence = [evidence_json(e) for e in repo.list_evidence(s) if device_key is None or e.device_key == device_key]
    return Snapshot(exported_at=exported_at, devices=[DeviceOut.of(d) for d in devices],
                    entries=entries, evidence=evidence)

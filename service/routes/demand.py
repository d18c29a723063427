"""GET /v1/demand: the most-missed (device, problem) pairs, for an offline tuning job."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter

from db import repository as repo
from service.deps import ReadAuth, StateDep
from service.routes._common import READ, Limit, Offset, next_offset, responses, text_query
from service.schemas import DemandOut, DemandPage

router = APIRouter(prefix="/v1/demand", tags=["demand"])


@router.get("", response_model=DemandPage, responses=responses(*READ))
def list_demand(
    _: ReadAuth,
    state: StateDep,
    device_key: Annotated[str | None, text_query("only this device key", 128)] = None,
    untuned_only: bool = False,
    offset: Offset = 0,
    limit: Limit = 50,
) -> DemandPage:
    """Lookup misses counted per (device, problem): most missed first, then most recent.
    `untuned_only` leaves out pairs that have a winner by now. Each item carries the canonical
    problem and the device fingerprint, ready for `POST /v1/jobs`. A read writes nothing: the
    misses of the last flush interval (DEMAND_FLUSH_SECONDS, 0.5 s) may not be counted yet."""
    with state.database.session(read_only=True) as s:
        items = repo.list_demand(s, limit, offset=offset, device_key=device_key,
                                 untuned_only=untuned_only)
    return DemandPage(items=[DemandOut.of(d) for d in items], offset=offset, limit=limit,
                      next_offset=next_offset(offset, len(items), None, limit))

"""POST /v1/lookup and /v1/lookup/batch: which strategy to use (see service.lookups)."""

from __future__ import annotations

from fastapi import APIRouter

from service.deps import ReadAuth, StateDep
from service.errors import invalid
from service.routes._common import READ, responses
from service.schemas import Lookup, LookupBatch, LookupBatchRequest, LookupRequest

router = APIRouter(prefix="/v1/lookup", tags=["lookup"])


@router.post("", response_model=Lookup, responses=responses(*READ, 413))
async def lookup(_: ReadAuth, req: LookupRequest, state: StateDep) -> Lookup:
    """The strategy for one problem on one device: `tuned`, `nearest`, `model` or `default`.
    Every answer that is not `tuned` counts as tuning demand (`GET /v1/demand`)."""
    return (await state.lookups.run(req.device, [req.problem]))[0]


@router.post("/batch", response_model=LookupBatch, responses=responses(*READ, 413))
async def lookup_batch(_: ReadAuth, req: LookupBatchRequest, state: StateDep) -> LookupBatch:
    """Up to `AUTOTUNER_MAX_BATCH` (default 1000) problems of one device at once, answered in
    order; repeated problems are looked up once."""
    limit = state.settings.max_batch
    if len(req.problems) > limit:
        raise invalid(["body", "problems"], f"at most {limit} problems per batch, got "
                                            f"{len(req.problems)}")
    results = await state.lookups.run(req.device, req.problems)
    state.metrics.batch_size.observe(len(req.problems))
    return LookupBatch(device_key=state.parse_memo.key(req.device), results=results)

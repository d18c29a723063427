"""POST /v1/lookup and /v1/lookup/batch: which strategy to use (see service.lookups).

The answers' JSON is cached with them (:meth:`service.lookups.LookupEngine.run_json`) and sent
as is; ``X-Autotuner-Process`` names the server process that answered (its pid), so a client
or test can tell the workers of one service apart."""

from __future__ import annotations

import json
import os

from fastapi import APIRouter, Request, Response

from service.deps import ReadAuth, StateDep
from service.errors import invalid
from service.pacing import SCOPE_KEY
from service.routes._common import READ, ErrorOut, responses
from service.schemas import Lookup, LookupBatch, LookupBatchRequest, LookupRequest

router = APIRouter(prefix="/v1/lookup", tags=["lookup"])
# service.ratelimit answers 429 in front of these routes (and of the fast path)
LIMITED = {429: {"model": ErrorOut, "description": "No valid token, and past a limit on anonymous lookups "
                 "(the detail names it and its AUTOTUNER_ setting; see Retry-After)"}}

PROCESS_HEADER = "x-autotuner-process"
JSON = "application/json"


def _headers() -> dict[str, str]:
    return {PROCESS_HEADER: str(os.getpid())}  # per call: a forked worker has its own pid


@router.post("", response_model=Lookup, responses={**responses(*READ, 413), **LIMITED})
async def lookup(_: ReadAuth, req: LookupRequest, state: StateDep) -> Response:
    """The strategy for one problem on one device: `tuned`, `nearest`, `model` or `default`.
    Every answer that is not `tuned` counts as tuning demand (`GET /v1/demand`)."""
    body = (await state.lookups.run_json(req.device, [req.problem]))[0]
    return Response(body, media_type=JSON, headers=_headers())


@router.post("/batch", response_model=LookupBatch, responses={**responses(*READ, 413), **LIMITED})
async def lookup_batch(_: ReadAuth, req: LookupBatchRequest, state: StateDep, request: Request) -> Response:
    """Up to `AUTOTUNER_MAX_BATCH` (default 1000) problems of one device at once, answered in
    order; repeated problems are looked up once."""
    limit = state.settings.max_batch
    if len(req.problems) > limit:
        raise invalid(["body", "problems"], f"at most {limit} problems per batch, got "
                                            f"{len(req.problems)}")
    # an anonymous batch: answered in the pacer's slices (service.pacing)
    results = await state.lookups.run_json(req.device, req.problems, pacer=request.scope.get(SCOPE_KEY))
    state.metrics.batch_size.observe(len(req.problems))
    dkey = json.dumps(state.parse_memo.key(req.device)).encode()
    body = b'{"device_key":%s,"results":[%s]}' % (dkey, b",".join(results))
    return Response(body, media_type=JSON, headers=_headers())

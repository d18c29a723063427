"""POST /v1/results: tuning jobs upload measurements; the winner is recomputed with them."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException

from autotuner.tune import store
from service.deps import ResultsAuth, StateDep
from service.errors import invalid
from service.routes._common import WRITE, responses
from service.schemas import ResultsRequest, ResultsResponse, WinnerOut

router = APIRouter(prefix="/v1/results", tags=["results"])


@router.post("", response_model=ResultsResponse, status_code=201, responses=responses(*WRITE))
def post_results(grant: ResultsAuth, req: ResultsRequest, state: StateDep) -> ResultsResponse:
    """Store the measurements of one problem on one device and recompute its winner, in one
    transaction (`autotuner.tune.store.save`). `ratio` is baseline time / the strategy's time.
    Each measurement records who wrote it: its `source` (`tuned` when omitted; an in-job token may
    upload only `in-job` ones, and those are its default) and the stored token that sent it.
    Sending the same upload again (its answer lost) is safe: a measurement that repeats a stored
    one of its run (`run_id`, strategy, status, reason, samples) is counted in `repeated`, not
    stored twice."""
    items: list[dict[str, Any]] = []
    in_job = grant.scope == "in-job"
    for i, m in enumerate(req.measurements):
        key = m.strategy.key
        if m.strategy_key is not None and m.strategy_key != key:
            raise invalid(["body", "measurements", i, "strategy_key"],
                          f"{m.strategy_key!r} does not match the strategy (its key is {key!r})",
                          m.strategy_key)
        if in_job and m.source not in (None, "in-job"):
            raise HTTPException(403, f"measurements[{i}]: an in-job token uploads in-job measurements only, "
                                     f"not {m.source!r}")
        item = m.model_dump(exclude={"strategy", "strategy_key"}, exclude_none=True)
        item.update(strategy=m.strategy.to_dict(), strategy_key=key)
        if in_job:
            item["source"] = "in-job"
        items.append(item)
    winner, recorded = store.record(state.database, req.device, req.problem, items, name=req.name,
                                    token_id=grant.token_id)
    dkey, pkey = state.parse_memo.key(req.device), state.parse_memo.key(req.problem)
    state.lookups.forget(dkey, pkey)
    return ResultsResponse(device_key=dkey, problem_key=pkey, recorded=recorded, repeated=len(items) - recorded,
                           winner=WinnerOut.of(winner) if winner is not None else None)

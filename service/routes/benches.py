"""GET /v1/model-benches: the stored `autotuner bench-model` runs (plain jit against overlapped,
per step), as the dashboard's /models pages show them. Read-only; bench-model --db writes them."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from db import NotFoundError
from db import repository as repo
from service.deps import ReadAuth, ReadSessionDep
from service.routes._common import MAX_ID, READ, Limit, responses, text_query
from service.schemas import ModelBenchOut

router = APIRouter(prefix="/v1/model-benches", tags=["model-benches"])


@router.get("", response_model=list[ModelBenchOut], responses=responses(*READ))
def list_model_benches(
    _: ReadAuth,
    s: ReadSessionDep,
    device_key: Annotated[str | None, text_query("only this device key", 128)] = None,
    program: Annotated[str | None, text_query("only this program (MODULE:FACTORY)", 512)] = None,
    limit: Limit = 50,
) -> list[ModelBenchOut]:
    """Bench-model runs, newest first: medians per step with their 95% intervals, the speedup
    (plain / overlapped) with its interval, the `slower` flag and the per-pair breakdown."""
    return [ModelBenchOut.of(b) for b in repo.list_model_benches(s, device_key, program=program, limit=limit)]


@router.get("/{bench_id}", response_model=ModelBenchOut, responses=responses(*READ, 404))
def get_model_bench(_: ReadAuth, bench_id: Annotated[int, Path(ge=1, le=MAX_ID)],
                    s: ReadSessionDep) -> ModelBenchOut:
    """One bench-model run."""
    got = repo.get_model_bench(s, bench_id)
    if got is None:
        raise NotFoundError(f"bench-model run {bench_id} does not exist")
    return ModelBenchOut.of(got)

"""GET /v1/problems (filter, sort, paginate) and GET /v1/problems/{problem} (every measurement)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from db import NotFoundError
from db import repository as repo
from service.deps import ReadAuth, ReadSessionDep
from service.routes._common import MAX_ID, READ, Limit, Offset, next_offset, responses, text_query
from service.schemas import (
    MeasurementOut,
    ProblemDetail,
    ProblemOut,
    ProblemPage,
    ProblemRowOut,
    SortKey,
    WinnerOut,
)

router = APIRouter(prefix="/v1/problems", tags=["problems"])


@router.get("", response_model=ProblemPage, responses=responses(*READ))
def list_problems(
    _: ReadAuth,
    s: ReadSessionDep,
    device_key: Annotated[str | None, text_query("only winners on this device key", 128)] = None,
    pattern: Annotated[str | None, text_query("e.g. all_gather:lhs:free")] = None,
    dtype: Annotated[str | None, text_query("float32, bfloat16 or float16", 32)] = None,
    method: Annotated[str | None, text_query("the winner's method: baseline or ring", 64)] = None,
    search: Annotated[str | None, text_query("problem key prefix or equation substring")] = None,
    tuned_only: bool = True,
    sort: SortKey = "updated",
    desc: bool = True,
    offset: Offset = 0,
    limit: Limit = 50,
) -> ProblemPage:
    """One row per (problem, device winner); with `tuned_only=false` problems without a winner
    too. Sorted by `sort` (missing values last), ties by problem id."""
    page = repo.list_problems(s, device_key=device_key, pattern=pattern, dtype=dtype, method=method,
                              search=search, tuned_only=tuned_only, sort=sort, desc=desc,
                              offset=offset, limit=limit)
    items = [ProblemRowOut.model_validate(r) for r in page.items]
    return ProblemPage(items=items, total=page.total, offset=offset, limit=limit,
                       next_offset=next_offset(offset, len(items), page.total, limit))


@router.get("/{problem}", response_model=ProblemDetail, responses=responses(*READ, 404))
def get_problem(
    _: ReadAuth,
    problem: Annotated[str, Path(min_length=1, max_length=128, pattern=r"^[0-9A-Za-z_-]+$",
                                 description="numeric id or problem key")],
    s: ReadSessionDep,
) -> ProblemDetail:
    """A problem with its winner on every device and every measurement (oldest first)."""
    if problem.isdigit() and int(problem) <= MAX_ID:
        record = repo.get_problem(s, int(problem))
    else:
        record = repo.get_problem_by_key(s, problem)
    if record is None:
        raise NotFoundError(f"problem {problem} does not exist")
    rows = repo.list_problems(s, search=record.key, tuned_only=True, sort="key", limit=1000).items
    winners = [WinnerOut.of(r.winner) for r in rows
               if r.winner is not None and r.problem.id == record.id]
    devices = {d.id: d.key for d in repo.list_devices(s)}
    measurements = [MeasurementOut.of(m, device_key=devices.get(m.device_id))
                    for m in repo.list_measurements(s, record.id)]
    return ProblemDetail(problem=ProblemOut.of(record), winners=winners, measurements=measurements)

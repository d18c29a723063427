"""Tuning jobs: a queue with leases, so a dead worker's job goes back to the queue."""

from __future__ import annotations

import logging
from typing import Annotated, Literal

from fastapi import APIRouter, Path

from db import NotFoundError
from db import repository as repo
from service.deps import ReadAuth, ReadSessionDep, SessionDep, StateDep, WriteAuth
from service.routes._common import (
    MAX_ID,
    READ,
    WRITE,
    Limit,
    Offset,
    next_offset,
    responses,
    text_query,
)
from service.schemas import (
    CancelRequest,
    ClaimRequest,
    ClaimResponse,
    DemandJobsRequest,
    FinishRequest,
    HeartbeatRequest,
    JobList,
    JobOut,
    JobPage,
    JobRequest,
    ReleaseRequest,
    RetryRequest,
)

log = logging.getLogger("service")

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

JobId = Annotated[int, Path(ge=1, le=MAX_ID)]


@router.post("", response_model=JobOut, status_code=201, responses=responses(*WRITE))
def enqueue(_: WriteAuth, req: JobRequest, s: SessionDep, state: StateDep) -> JobOut:
    """Queue tuning of a problem on a device. At most one job per (device, problem) is active:
    if one is queued or running, that one is returned."""
    key = state.parse_memo.key
    job = repo.enqueue_job(s, problem_key=key(req.problem), problem=req.problem.canonical(),
                           device_key=key(req.device), device=req.device.to_dict(),
                           params=req.params, priority=req.priority)
    return JobOut.of(job)


@router.get("", response_model=JobPage, responses=responses(*READ))
def list_jobs(
    _: ReadAuth,
    s: ReadSessionDep,
    status: Literal["queued", "running", "done", "failed"] | None = None,
    device_key: Annotated[str | None, text_query("only jobs of this device key", 128)] = None,
    offset: Offset = 0,
    limit: Limit = 50,
) -> JobPage:
    """Jobs, newest first."""
    page = repo.list_jobs(s, status=status, device_key=device_key, offset=offset, limit=limit)
    return JobPage(items=[JobOut.of(j) for j in page.items], total=page.total, offset=offset,
                   limit=limit, next_offset=next_offset(offset, len(page.items), page.total, limit))


@router.post("/claim", response_model=ClaimResponse, responses=responses(*WRITE))
def claim(_: WriteAuth, req: ClaimRequest, s: SessionDep, state: StateDep) -> ClaimResponse:
    """Claim the next job (highest priority, oldest; queued, or running with an expired lease)
    under a lease of `lease_seconds` (default `AUTOTUNER_LEASE_SECONDS`). `job` is null when
    there is nothing to claim. With `max_attempts`, only jobs claimed fewer times are claimed,
    and running jobs whose lease ran out after that many claims are failed first (`abandoned`)."""
    lease = req.lease_seconds or state.settings.lease_seconds
    abandoned = ([] if req.max_attempts is None
                 else repo.fail_abandoned(s, req.max_attempts, device_key=req.device_key))
    for j in abandoned:
        log.warning("job %d failed: %s", j.id, j.error)
    job = repo.claim_job(s, req.worker, lease, device_key=req.device_key,
                         max_attempts=req.max_attempts)
    return ClaimResponse(job=JobOut.of(job) if job is not None else None,
                         abandoned=[JobOut.of(j) for j in abandoned])


@router.post("/from-demand", response_model=JobList, responses=responses(*WRITE))
def from_demand(_: WriteAuth, req: DemandJobsRequest, s: SessionDep) -> JobList:
    """Queue a job for each of the `limit` problems that lookups missed most on the device
    `device_key` (`GET /v1/demand`; at least `min_count` misses) and that have no winner and never
    had a job; returns the new jobs. A pair whose job failed or left no winner is not queued from
    demand again (`POST /v1/jobs` does). `autotuner worker --from-demand N` asks for this when the
    queue is empty."""
    jobs = repo.enqueue_demand(s, req.device_key, limit=req.limit, min_count=req.min_count,
                               params=req.params, priority=req.priority)
    return JobList(items=[JobOut.of(j) for j in jobs])


@router.get("/{job_id}", response_model=JobOut, responses=responses(*READ, 404))
def get_job(_: ReadAuth, job_id: JobId, s: ReadSessionDep) -> JobOut:
    job = repo.get_job(s, job_id)
    if job is None:
        raise NotFoundError(f"job {job_id} does not exist")
    return JobOut.of(job)


@router.post("/{job_id}/heartbeat", response_model=JobOut, responses=responses(*WRITE, 404, 409))
def heartbeat(_: WriteAuth, job_id: JobId, req: HeartbeatRequest, s: SessionDep,
              state: StateDep) -> JobOut:
    """Extend the worker's lease; 409 if the worker no longer holds the job."""
    lease = req.lease_seconds or state.settings.lease_seconds
    return JobOut.of(repo.heartbeat_job(s, job_id, req.worker, lease))


@router.post("/{job_id}/finish", response_model=JobOut, responses=responses(*WRITE, 404, 409))
def finish(_: WriteAuth, job_id: JobId, req: FinishRequest, s: SessionDep) -> JobOut:
    """Mark the worker's job done or failed (final); 409 if the worker does not hold it."""
    return JobOut.of(repo.finish_job(s, job_id, req.worker, req.status, req.error))




@router.post("/{job_id}/release", response_model=JobOut, responses=responses(*WRITE, 404, 409))
def release(_: WriteAuth, job_id: JobId, req: ReleaseRequest, s: SessionDep) -> JobOut:
    """Hand the worker's job back to the queue now (a worker being stopped), not when its lease
    expires; the claim is not counted in `attempts`. 409 if the worker does not hold it."""
    return JobOut.of(repo.release_job(s, job_id, req.worker))


@router.post("/{job_id}/retry", response_model=JobOut, status_code=201, responses=responses(*WRITE, 404))
def retry(_: WriteAuth, job_id: JobId, s: SessionDep, req: RetryRequest | None = None) -> JobOut:
    """Queue the job's (device, problem) again, as a new job with its params and priority unless
    the body gives others (a failed job, once its cause is fixed; a done one, to tune it anew).
    Where the pair has an active job, that one is returned."""
    req = req or RetryRequest()
    return JobOut.of(repo.retry_job(s, job_id, params=req.params, priority=req.priority))


@router.post("/{job_id}/cancel", response_model=JobOut, responses=responses(*WRITE, 404))
def cancel(_: WriteAuth, job_id: JobId, s: SessionDep, req: CancelRequest | None = None) -> JobOut:
    """Fail a queued or running job now (`cancelled: REASON`); the worker tuning it is refused at
    its next heartbeat and stops after the batch it is measuring. A finished job is returned as it is."""
    return JobOut.of(repo.cancel_job(s, job_id, (req or CancelRequest()).reason))

"""Tuning jobs (a leased work queue) and lookup-miss demand (private; see db.repository)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import and_, case, delete, func, or_, select, text, update
from sqlalchemy.orm import Session

from db._common import (
    check_page,
    check_value,
    check_values,
    dialect,
    insert,
    named_lock,
    now_utc,
    seconds,
    text_field,
)
from db._convert import demand_record, job_record
from db.errors import LeaseError, NotFoundError, StorageError
from db.fields import INT_MAX, fields_of
from db.records import DemandRecord, JobRecord, Page
from db.tables import Demand, Device, Problem, TuningJob, Winner

ACTIVE = ("queued", "running")
FINAL = ("done", "failed")
_ACTIVE_SQL = "status IN ('queued', 'running')"
_CLAIM_TRIES = 8
_JOB = fields_of(JobRecord)
_ENQUEUED = fields_of(JobRecord, ("problem_key", "problem", "device_key", "device", "params"))
_MISSED = fields_of(DemandRecord, ("device_key", "device", "problem_key", "problem"))


# --------------------------------------------------------------------------- jobs


def _active_job(s: Session, device_key: str, problem_key: str) -> TuningJob | None:
    return s.execute(
        select(TuningJob)
        .where(
            TuningJob.device_key == device_key,
            TuningJob.problem_key == problem_key,
            TuningJob.status.in_(ACTIVE),
        )
        .execution_options(populate_existing=True)
    ).scalar_one_or_none()


def enqueue_job(
    s: Session,
    *,
    problem_key: str,
    problem: dict[str, Any],
    device_key: str,
    device: dict[str, Any],
    params: dict[str, Any] | None = None,
    priority: int = 0,
    now: datetime | None = None,
) -> JobRecord:
    """Queue tuning of ``problem`` (canonical JSON) on ``device`` (fingerprint JSON).

    At most one job per (device, problem) is active: if one is queued or running already,
    that one is returned unchanged. ``params`` (e.g. trials/seconds/target) go to the worker;
    higher ``priority`` is claimed first.
    """
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an integer, not {priority!r}")
    ts = now_utc(now)
    values = check_values(_ENQUEUED, {"problem_key": problem_key, "problem": problem,
                                      "device_key": device_key, "device": device,
                                      "params": params if params is not None else {}})
    values.update(priority=priority, status="queued", attempts=0, created_at=ts, updated_at=ts)
    for _ in range(3):  # the active job may finish between the insert and the select
        stmt = (
            insert(s, TuningJob)
            .values(**values)
            .on_conflict_do_nothing(
                index_elements=["device_key", "problem_key"], index_where=text(_ACTIVE_SQL)
            )
        )
        s.execute(stmt)
        row = _active_job(s, device_key, problem_key)
        if row is not None:
            return job_record(row)
    raise StorageError(f"could not enqueue job for {device_key}/{problem_key}: it kept finishing")


def _expired(now: datetime) -> Any:
    """A running job whose lease ran out: its worker died, was killed or hung."""
    return and_(TuningJob.status == "running", TuningJob.lease_expires_at < now)


def _positive(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, not {value!r}")


def _claimable(now: datetime, device_key: str | None, max_attempts: int | None) -> Any:
    cond = or_(TuningJob.status == "queued", _expired(now))
    if device_key is not None:
        cond = and_(cond, TuningJob.device_key == device_key)
    if max_attempts is not None:
        cond = and_(cond, TuningJob.attempts < max_attempts)
    return cond


def claim_job(
    s: Session,
    worker: str,
    lease_seconds: float,
    now: datetime | None = None,
    *,
    device_key: str | None = None,
    max_attempts: int | None = None,
) -> JobRecord | None:
    """Claim the next job for ``worker``: the highest-priority, oldest job that is queued or
    whose running lease has expired (optionally only for ``device_key``, and only jobs
    claimed fewer than ``max_attempts`` times). It becomes ``running`` under a lease of
    ``lease_seconds``; ``attempts`` counts claims. ``None`` if there is nothing to claim.

    Atomic under concurrency: the candidate is selected (``FOR UPDATE SKIP LOCKED`` on
    PostgreSQL) and then taken with an UPDATE that re-checks the claimable condition; a lost
    race (rowcount 0) moves on to the next candidate.
    """
    worker = text_field(worker, "worker", max_len=_JOB["worker"].max_len or 0) or ""  # required here
    ts = now_utc(now)
    lease = seconds(lease_seconds, "lease_seconds")
    is_pg = dialect(s) == "postgresql"
    for _ in range(_CLAIM_TRIES):
        cond = _claimable(ts, device_key, max_attempts)
        pick = (
            select(TuningJob.id)
            .where(cond)
            .order_by(TuningJob.priority.desc(), TuningJob.created_at, TuningJob.id)
            .limit(1)
        )
        if is_pg:
            pick = pick.with_for_update(skip_locked=True)
        job_id = s.execute(pick).scalar_one_or_none()
        if job_id is None:
            return None
        result = s.execute(
            update(TuningJob)
            .where(TuningJob.id == job_id, cond)
            .values(
                status="running",
                worker=worker,
                lease_expires_at=ts + lease,
                attempts=TuningJob.attempts + 1,
                error=None,
                updated_at=ts,
            )
            .execution_options(synchronize_session=False)
        )
        if result.rowcount == 1:  # type: ignore[attr-defined]
            return _get_job_row(s, job_id)
    return None


def fail_abandoned(s: Session, max_attempts: int, now: datetime | None = None, *,
                   device_key: str | None = None) -> list[JobRecord]:
    """Fail every running job (of ``device_key``, if given) whose lease ran out after its
    ``max_attempts``-th claim: each worker that held it died, was killed or hung (a problem that
    kills its process, e.g. out of memory, would otherwise take down one worker per lease,
    forever). Returns them. Jobs a worker handed back (:func:`release_job`) are not counted."""
    _positive(max_attempts, "max_attempts")
    ts = now_utc(now)
    cond = and_(_expired(ts), TuningJob.attempts >= max_attempts)
    if device_key is not None:
        cond = and_(cond, TuningJob.device_key == device_key)
    failed = []
    for job_id, attempts in s.execute(select(TuningJob.id, TuningJob.attempts).where(cond).order_by(TuningJob.id)).all():
        held = "its worker's lease" if attempts == 1 else f"claimed {attempts} times, and each worker's lease"
        error = (f"abandoned: {held} ran out before it finished (the worker died, was killed, e.g. for "
                 f"memory, or hung); once the cause is fixed, queue it again: POST /v1/jobs/{job_id}/retry")
        done = s.execute(update(TuningJob).where(TuningJob.id == job_id, cond)
                         .values(status="failed", lease_expires_at=None, updated_at=ts, error=error)
                         .execution_options(synchronize_session=False))
        if done.rowcount == 1:  # type: ignore[attr-defined]
            failed.append(_get_job_row(s, job_id))
    return failed


def _get_job_row(s: Session, job_id: int) -> JobRecord:
    row = s.execute(
        select(TuningJob).where(TuningJob.id == job_id).execution_options(populate_existing=True)
    ).scalar_one()
    return job_record(row)


def _held(s: Session, job_id: int, worker: str, values: dict[str, Any]) -> JobRecord:
    result = s.execute(
        update(TuningJob)
        .where(TuningJob.id == job_id, TuningJob.worker == worker, TuningJob.status == "running")
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount == 1:  # type: ignore[attr-defined]
        return _get_job_row(s, job_id)
    current = s.get(TuningJob, job_id, populate_existing=True)
    if current is None:
        raise NotFoundError(f"job {job_id} does not exist")
    raise LeaseError(
        f"job {job_id} is not held by worker {worker!r} "
        f"(status {current.status!r}, worker {current.worker!r})"
    )


def heartbeat_job(
    s: Session, job_id: int, worker: str, lease_seconds: float, now: datetime | None = None
) -> JobRecord:
    """Extend ``worker``'s lease on a running job to ``now + lease_seconds``.

    Raises :class:`LeaseError` if the worker no longer holds it (finished, or re-claimed by
    another worker after the lease expired), :class:`NotFoundError` if there is no such job.
    """
    ts = now_utc(now)
    lease = seconds(lease_seconds, "lease_seconds")
    return _held(s, job_id, worker, {"lease_expires_at": ts + lease, "updated_at": ts})


def finish_job(
    s: Session,
    job_id: int,
    worker: str,
    status: str,
    error: str | None = None,
    now: datetime | None = None,
) -> JobRecord:
    """Mark ``worker``'s running job ``"done"`` or ``"failed"`` (with ``error``); final.

    Raises :class:`LeaseError` / :class:`NotFoundError` as :func:`heartbeat_job`.
    """
    if status not in FINAL:
        raise ValueError(f"status must be one of {FINAL}, not {status!r}")
    ts = now_utc(now)
    values = {
        "status": status,
        "error": check_value(_JOB["error"], error, "error"),
        "lease_expires_at": None,
        "updated_at": ts,
    }
    return _held(s, job_id, worker, values)


def release_job(s: Session, job_id: int, worker: str, now: datetime | None = None) -> JobRecord:
    """Hand ``worker``'s running job back to the queue at once (a worker that is stopped), rather
    than when its lease expires: ``queued`` again, no worker, no lease, and the claim not counted
    in ``attempts`` (nothing was tried to the end).

    Raises :class:`LeaseError` / :class:`NotFoundError` as :func:`heartbeat_job`.
    """
    ts = now_utc(now)
    values = {"status": "queued", "worker": None, "lease_expires_at": None,
              "attempts": TuningJob.attempts - 1, "updated_at": ts}
    return _held(s, job_id, worker, values)


def cancel_job(s: Session, job_id: int, reason: str | None = None, now: datetime | None = None) -> JobRecord:
    """Fail a queued or running job now (an operator's decision): ``failed`` with ``cancelled``
    and ``reason`` as its error, no lease; a worker tuning it is refused at its next heartbeat
    and stops. A finished job is returned unchanged. Raises :class:`NotFoundError`."""
    ts = now_utc(now)
    error = check_value(_JOB["error"], "cancelled" + (f": {reason}" if reason else ""), "reason")
    s.execute(update(TuningJob).where(TuningJob.id == job_id, TuningJob.status.in_(ACTIVE))
              .values(status="failed", error=error, lease_expires_at=None, updated_at=ts)
              .execution_options(synchronize_session=False))
    job = get_job(s, job_id)
    if job is None:
        raise NotFoundError(f"job {job_id} does not exist")
    return job


def retry_job(s: Session, job_id: int, *, params: dict[str, Any] | None = None, priority: int | None = None,
              now: datetime | None = None) -> JobRecord:
    """Queue job ``job_id``'s (device, problem) again, as a new job with its ``params`` and
    ``priority`` unless given (a failed job's record stays, with its error). Where the pair has
    an active job (this one, or another), that one is returned, as :func:`enqueue_job` does.
    Raises :class:`NotFoundError` if there is no such job."""
    row = s.get(TuningJob, job_id)
    if row is None:
        raise NotFoundError(f"job {job_id} does not exist")
    return enqueue_job(s, problem_key=row.problem_key, problem=row.problem, device_key=row.device_key,
                       device=row.device, params=row.params if params is None else params,
                       priority=row.priority if priority is None else priority, now=now)


def get_job(s: Session, job_id: int) -> JobRecord | None:
    row = s.get(TuningJob, job_id, populate_existing=True)
    return job_record(row) if row is not None else None


def list_jobs(
    s: Session,
    *,
    status: str | None = None,
    device_key: str | None = None,
    offset: int = 0,
    limit: int = 50,
) -> Page[JobRecord]:
    """Jobs, newest first, optionally by ``status`` and ``device_key``."""
    check_page(offset, limit)
    stmt = select(TuningJob)
    if status is not None:
        stmt = stmt.where(TuningJob.status == status)
    if device_key is not None:
        stmt = stmt.where(TuningJob.device_key == device_key)
    total = s.execute(select(func.count()).select_from(stmt.subquery())).scalar_one()
    rows = s.scalars(
        stmt.order_by(TuningJob.created_at.desc(), TuningJob.id.desc()).offset(offset).limit(limit)
    )
    return Page(items=tuple(job_record(r) for r in rows), total=total, offset=offset, limit=limit)


# --------------------------------------------------------------------------- demand


def _add(count: Any, more: Any) -> Any:
    """``count + more``, at most INT_MAX (the column's range): a count saturates."""
    return case((count > INT_MAX - more, INT_MAX), else_=count + more)


def record_miss(
    s: Session,
    device_key: str,
    device_json: dict[str, Any],
    problem_key: str,
    problem_canonical: dict[str, Any],
    now: datetime | None = None,
) -> DemandRecord:
    """Count one lookup miss of (device, problem): insert with count 1, or add 1 and move
    ``last_seen`` (one atomic upsert; safe under concurrency)."""
    ts = now_utc(now)
    values = check_values(_MISSED, {"device_key": device_key, "device": device_json,
                                    "problem_key": problem_key, "problem": problem_canonical})
    stmt = insert(s, Demand).values(**values, count=1, first_seen=ts, last_seen=ts)
    stmt = stmt.on_conflict_do_update(
        index_elements=["device_key", "problem_key"],
        set_={"count": _add(Demand.count, 1), "last_seen": stmt.excluded.last_seen},
    )
    s.execute(stmt)
    row = s.execute(
        select(Demand)
        .where(Demand.device_key == device_key, Demand.problem_key == problem_key)
        .execution_options(populate_existing=True)
    ).scalar_one()
    return demand_record(row)


def record_misses(
    s: Session,
    misses: list[tuple[str, dict[str, Any], str, dict[str, Any], int]],
    now: datetime | None = None,
) -> int:
    """Count many lookup misses at once: ``(device_key, device_json, problem_key,
    problem_canonical, count)`` each, as :func:`record_miss` would ``count`` times (one upsert
    per (device, problem), nothing read back). Returns how many misses were counted."""
    ts = now_utc(now)
    rows = []
    for device_key, device_json, problem_key, canonical, count in misses:
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ValueError(f"count must be an integer >= 1, not {count!r}")
        count = min(count, INT_MAX)
        values = check_values(_MISSED, {"device_key": device_key, "device": device_json,
                                        "problem_key": problem_key, "problem": canonical})
        rows.append({**values, "count": count, "first_seen": ts, "last_seen": ts})
    if not rows:
        return 0
    table = Demand.__table__
    stmt = insert(s, table)
    stmt = stmt.on_conflict_do_update(  # Core, one statement executed for every row
        index_elements=["device_key", "problem_key"],
        set_={"count": _add(table.c.count, stmt.excluded.count), "last_seen": stmt.excluded.last_seen},
    )
    s.connection().execute(stmt, rows)
    return sum(r["count"] for r in rows)


def trim_demand(s: Session, max_rows: int) -> int:
    """Keep the demand table within ``max_rows`` rows: once it holds more, delete the least
    missed (then the least recently missed) down to 90% of ``max_rows``, so that a flood of
    distinct misses costs one such delete per ``max_rows / 10`` new rows. Returns how many
    rows were deleted."""
    if not isinstance(max_rows, int) or max_rows < 1:
        raise ValueError(f"max_rows must be an integer >= 1, not {max_rows!r}")
    total = s.scalar(select(func.count()).select_from(Demand)) or 0
    if total <= max_rows:
        return 0
    excess = total - (max_rows - max_rows // 10)
    victims = select(Demand.id).order_by(Demand.count, Demand.last_seen, Demand.id).limit(excess)
    return s.execute(delete(Demand).where(Demand.id.in_(victims))).rowcount or 0


def _tuned() -> Any:
    """EXISTS a winner of the demand row's (device, problem): correlated with ``Demand``."""
    return (
        select(Winner.id)
        .join(Device, Winner.device_id == Device.id)
        .join(Problem, Winner.problem_id == Problem.id)
        .where(Device.key == Demand.device_key, Problem.key == Demand.problem_key)
        .exists()
    )


def enqueue_demand(
    s: Session,
    device_key: str,
    *,
    limit: int = 10,
    min_count: int = 1,
    params: dict[str, Any] | None = None,
    priority: int = 0,
    now: datetime | None = None,
) -> list[JobRecord]:
    """Queue a tuning job for each of the ``limit`` most-missed problems of ``device_key``
    (missed at least ``min_count`` times) that have no winner and never had a job; returns the
    new jobs, most missed first. A pair whose job failed, or left no winner, is not queued
    again from demand (queue it by hand, :func:`enqueue_job`): lookups that go on missing it
    would otherwise retry it forever."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 1000:
        raise ValueError(f"limit must be an integer from 1 to 1000, not {limit!r}")
    _positive(min_count, "min_count")
    # two workers asking at once (a pool's replicas, idle together) must not both read "no job":
    # the second would be handed the first's jobs (one active job per pair) as its own, and not
    # go on to the next pairs. It waits for the first's transaction, then sees its jobs
    named_lock(s, f"demand-jobs:{device_key}")
    had_job = (
        select(TuningJob.id)
        .where(TuningJob.device_key == Demand.device_key, TuningJob.problem_key == Demand.problem_key)
        .exists()
    )
    rows = s.scalars(
        select(Demand)
        .where(Demand.device_key == device_key, Demand.count >= min_count, ~_tuned(), ~had_job)
        .order_by(Demand.count.desc(), Demand.last_seen.desc(), Demand.id)
        .limit(limit)
    ).all()
    return [
        enqueue_job(s, problem_key=r.problem_key, problem=r.problem, device_key=r.device_key,
                    device=r.device, params=params, priority=priority, now=now)
        for r in rows
    ]


def list_demand(
    s: Session,
    limit: int = 50,
    *,
    offset: int = 0,
    device_key: str | None = None,
    untuned_only: bool = False,
) -> list[DemandRecord]:
    """The most-missed (device, problem) pairs: highest count first, then most recent.

    ``untuned_only`` drops pairs that have a stored winner by now.
    """
    check_page(offset, limit)
    stmt = select(Demand)
    if device_key is not None:
        stmt = stmt.where(Demand.device_key == device_key)
    if untuned_only:
        stmt = stmt.where(~_tuned())
    stmt = stmt.order_by(Demand.count.desc(), Demand.last_seen.desc(), Demand.id)
    return [demand_record(r) for r in s.scalars(stmt.offset(offset).limit(limit))]

"""ORM rows -> frozen records (private to :mod:`db`)."""

from __future__ import annotations

import copy
from typing import Any

from db.models import Demand, Device, Measurement, Problem, Token, TuningJob
from db.records import (
    DemandRecord,
    DeviceRecord,
    JobRecord,
    MeasurementRecord,
    ProblemRecord,
    TokenRecord,
    WinnerRecord,
)


def _obj(value: Any) -> Any:
    return copy.deepcopy(value)


def device_record(row: Device) -> DeviceRecord:
    return DeviceRecord(
        id=row.id,
        key=row.key,
        platform=row.platform,
        device_kind=row.device_kind,
        num_devices=row.num_devices,
        num_processes=row.num_processes,
        topology=row.topology,
        jax_version=row.jax_version,
        jaxlib_version=row.jaxlib_version,
        created_at=row.created_at,
    )


def problem_record(row: Problem) -> ProblemRecord:
    return ProblemRecord(
        id=row.id,
        key=row.key,
        canonical=_obj(row.canonical),
        equation=row.equation,
        pattern=row.pattern,
        dtype=row.dtype,
        mesh_size=row.mesh_size,
        m=row.m,
        n=row.n,
        k=row.k,
        b=row.b,
        flops=row.flops,
        comm_bytes=row.comm_bytes,
        created_at=row.created_at,
    )


def measurement_record(row: Measurement) -> MeasurementRecord:
    return MeasurementRecord(
        id=row.id,
        problem_id=row.problem_id,
        device_id=row.device_id,
        strategy=_obj(row.strategy),
        strategy_key=row.strategy_key,
        method=row.method,
        status=row.status,
        reason=row.reason,
        samples=tuple(float(x) for x in row.samples),
        median_s=row.median_s,
        iqr_s=row.iqr_s,
        min_s=row.min_s,
        n=row.n,
        ratio=row.ratio,
        ratio_lo=row.ratio_lo,
        ratio_hi=row.ratio_hi,
        compile_s=row.compile_s,
        memory=_obj(row.memory),
        run_id=row.run_id,
        host=row.host,
        created_at=row.created_at,
    )


def winner_record(row: Any, device_key: str, problem_key: str) -> WinnerRecord:
    return WinnerRecord(
        id=row.id,
        device_id=row.device_id,
        problem_id=row.problem_id,
        device_key=device_key,
        problem_key=problem_key,
        strategy=_obj(row.strategy),
        strategy_key=row.strategy_key,
        method=row.method,
        speedup=row.speedup,
        speedup_lo=row.speedup_lo,
        speedup_hi=row.speedup_hi,
        baseline_s=row.baseline_s,
        winner_s=row.winner_s,
        measurement_ids=tuple(int(x) for x in row.measurement_ids),
        trials=row.trials,
        created_at=row.created_at,
        updated_at=row.updated_at,
    )


def job_record(row: TuningJob) -> JobRecord:
    return JobRecord(
        id=row.id,
        problem_key=row.problem_key,
        problem=_obj(row.problem),
        device_key=row.device_key,
        device=_obj(row.device),
        status=row.status,
        priority=row.priority,
        params=_obj(row.params),
        worker=row.worker,
        lease_expires_at=row.lease_expires_at,
        attempts=row.attempts,
        error=row.error,
        created_at=row.created_at,
        updated_at=row.updated_at,
    )


def demand_record(row: Demand) -> DemandRecord:
    return DemandRecord(
        id=row.id,
        device_key=row.device_key,
        device=_obj(row.device),
        problem_key=row.problem_key,
        problem=_obj(row.problem),
        count=row.count,
        first_seen=row.first_seen,
        last_seen=row.last_seen,
    )


def token_record(row: Token) -> TokenRecord:
    return TokenRecord(
        id=row.id,
        name=row.name,
        scope=row.scope,
        created_at=row.created_at,
        revoked_at=row.revoked_at,
    )

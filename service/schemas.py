"""The API's request and response models (pydantic v2), apart from the ORM and the db records.

Requests carry domain objects through :mod:`service.fields` (validated by the domain code);
responses are built from the repository's frozen records with ``from_record`` helpers.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from db import (
    DemandRecord,
    DeviceRecord,
    JobRecord,
    MeasurementRecord,
    ProblemRecord,
    WinnerRecord,
)
from service.fields import DeviceField, JsonObject, ProblemField, StrategyField, Text

Source = Literal["tuned", "nearest", "model", "default"]
SortKey = Literal["updated", "created", "speedup", "flops", "comm_bytes", "trials", "key", "pattern"]

_Text = Field(min_length=1, max_length=256)
_FINITE = ConfigDict(allow_inf_nan=False, extra="forbid")
_OUT = ConfigDict(frozen=True)


# -- lookup ----------------------------------------------------------------------------------------

class LookupRequest(BaseModel):
    model_config = _FINITE
    device: DeviceField
    problem: ProblemField


class LookupBatchRequest(BaseModel):
    """At most ``AUTOTUNER_MAX_BATCH`` problems (default 1000), all for one device."""

    model_config = _FINITE
    device: DeviceField
    problems: list[ProblemField] = Field(min_length=1)


class Lookup(BaseModel):
    """The strategy to use for one problem on one device, and the evidence behind it.

    ``source``: ``tuned`` (this exact problem was measured on this device), ``nearest``
    (the winner of the closest tuned shape of the same pattern, dtype and mesh size on this
    device; ``distance`` is the log2-shape distance to it, ``neighbor_key`` its key),
    ``model`` (a cost model's prediction) or ``default`` (the baseline: nothing known).
    ``speedup`` is baseline time / strategy time as measured (for ``nearest``: on the
    neighbour), ``confidence`` its interval ``[lo, hi]`` where one was measured.
    ``record_id`` is the winner record's id, ``measured_at`` when it last changed.
    """

    model_config = _OUT
    strategy: dict[str, Any]
    strategy_key: str
    source: Source
    speedup: float | None
    confidence: tuple[float, float] | None = None
    record_id: int | None = None
    measured_at: datetime | None = None
    trials: int | None = None
    distance: float | None = None
    neighbor_key: str | None = None
    problem_key: str
    device_key: str


class LookupBatch(BaseModel):
    model_config = _OUT
    device_key: str
    results: list[Lookup]


# -- records ---------------------------------------------------------------------------------------

class DeviceOut(BaseModel):
    model_config = _OUT
    id: int
    key: str
    platform: str
    device_kind: str
    num_devices: int
    num_processes: int
    topology: str | None
    jax_version: str
    jaxlib_version: str
    created_at: datetime

    @classmethod
    def of(cls, r: DeviceRecord) -> DeviceOut:
        return cls(id=r.id, key=r.key, platform=r.platform, device_kind=r.device_kind,
                   num_devices=r.num_devices, num_processes=r.num_processes, topology=r.topology,
                   jax_version=r.jax_version, jaxlib_version=r.jaxlib_version, created_at=r.created_at)


class ProblemOut(BaseModel):
    model_config = _OUT
    id: int
    key: str
    canonical: dict[str, Any]
    equation: str
    pattern: str
    dtype: str
    mesh_size: int
    m: float
    n: float
    k: float
    b: float
    flops: float
    comm_bytes: float
    created_at: datetime

    @classmethod
    def of(cls, r: ProblemRecord) -> ProblemOut:
        return cls(id=r.id, key=r.key, canonical=r.canonical, equation=r.equation, pattern=r.pattern,
                   dtype=r.dtype, mesh_size=r.mesh_size, m=r.m, n=r.n, k=r.k, b=r.b, flops=r.flops,
                   comm_bytes=r.comm_bytes, created_at=r.created_at)


class WinnerOut(BaseModel):
    model_config = _OUT
    id: int
    device_key: str
    problem_key: str
    strategy: dict[str, Any]
    strategy_key: str
    method: str
    speedup: float
    speedup_lo: float | None
    speedup_hi: float | None
    baseline_s: float | None
    winner_s: float | None
    measurement_ids: list[int]
    trials: int
    created_at: datetime
    updated_at: datetime

    @classmethod
    def of(cls, r: WinnerRecord) -> WinnerOut:
        return cls(id=r.id, device_key=r.device_key, problem_key=r.problem_key, strategy=r.strategy,
                   strategy_key=r.strategy_key, method=r.method, speedup=r.speedup,
                   speedup_lo=r.speedup_lo, speedup_hi=r.speedup_hi, baseline_s=r.baseline_s,
                   winner_s=r.winner_s, measurement_ids=list(r.measurement_ids), trials=r.trials,
                   created_at=r.created_at, updated_at=r.updated_at)


class MeasurementOut(BaseModel):
    model_config = _OUT
    id: int
    problem_id: int
    device_id: int
    device_key: str | None
    strategy: dict[str, Any]
    strategy_key: str
    method: str
    status: str
    reason: str | None
    samples: list[float]
    median_s: float | None
    iqr_s: float | None
    min_s: float | None
    n: int
    ratio: float | None
    ratio_lo: float | None
    ratio_hi: float | None
    compile_s: float | None
    memory: dict[str, Any] | None
    run_id: str | None
    host: str | None
    created_at: datetime

    @classmethod
    def of(cls, r: MeasurementRecord, device_key: str | None) -> MeasurementOut:
        return cls(id=r.id, problem_id=r.problem_id, device_id=r.device_id, device_key=device_key,
                   strategy=r.strategy, strategy_key=r.strategy_key, method=r.method, status=r.status,
                   reason=r.reason, samples=list(r.samples), median_s=r.median_s, iqr_s=r.iqr_s,
                   min_s=r.min_s, n=r.n, ratio=r.ratio, ratio_lo=r.ratio_lo, ratio_hi=r.ratio_hi,
                   compile_s=r.compile_s, memory=r.memory, run_id=r.run_id, host=r.host,
                   created_at=r.created_at)


class ProblemRowOut(BaseModel):
    model_config = _OUT
    problem: ProblemOut
    device: DeviceOut | None
    winner: WinnerOut | None


class ProblemPage(BaseModel):
    """``items[0]`` is row ``offset`` of ``total``; ``next_offset`` is null on the last page."""

    model_config = _OUT
    items: list[ProblemRowOut]
    total: int
    offset: int
    limit: int
    next_offset: int | None


class ProblemDetail(BaseModel):
    model_config = _OUT
    problem: ProblemOut
    winners: list[WinnerOut]
    measurements: list[MeasurementOut]


# -- results ---------------------------------------------------------------------------------------

class MeasurementIn(BaseModel):
    """One timed strategy (see ``db.MeasurementInput``); ``ratio`` = baseline time / this time
    with its confidence interval ``ratio_lo``..``ratio_hi``. ``strategy_key`` is derived from
    ``strategy``; if given it must match."""

    model_config = _FINITE
    strategy: StrategyField
    strategy_key: Text | None = Field(default=None, max_length=256)
    status: Literal["ok", "failed"]
    reason: Text | None = Field(default=None, max_length=100_000)
    samples: list[float] = Field(default_factory=list, max_length=100_000)
    median_s: float | None = Field(default=None, ge=0)
    iqr_s: float | None = Field(default=None, ge=0)
    min_s: float | None = Field(default=None, ge=0)
    n: int | None = Field(default=None, ge=0, le=10_000_000)
    ratio: float | None = Field(default=None, ge=0)
    ratio_lo: float | None = Field(default=None, ge=0)
    ratio_hi: float | None = Field(default=None, ge=0)
    compile_s: float | None = Field(default=None, ge=0)
    memory: JsonObject | None = None
    run_id: Text | None = Field(default=None, max_length=64)
    host: Text | None = Field(default=None, max_length=256)

    @model_validator(mode="after")
    def _ok_has_median(self) -> MeasurementIn:
        if self.status == "ok" and self.median_s is None:
            raise ValueError('an "ok" measurement needs median_s')
        return self


class ResultsRequest(BaseModel):
    """Measurements of one problem on one device; the winner is recomputed in the same
    transaction."""

    model_config = _FINITE
    device: DeviceField
    problem: ProblemField
    measurements: list[MeasurementIn] = Field(min_length=1, max_length=10_000)


class ResultsResponse(BaseModel):
    model_config = _OUT
    device_key: str
    problem_key: str
    recorded: int
    winner: WinnerOut | None


# -- jobs ------------------------------------------------------------------------------------------

class JobRequest(BaseModel):
    model_config = _FINITE
    device: DeviceField
    problem: ProblemField
    params: JsonObject = Field(default_factory=dict)
    priority: int = Field(default=0, ge=-1_000_000, le=1_000_000)


class ClaimRequest(BaseModel):
    """Claim the next job: highest priority, oldest, queued or with an expired lease."""

    model_config = _FINITE
    worker: Text = _Text
    lease_seconds: float | None = Field(default=None, gt=0, le=86_400)
    device_key: Text | None = Field(default=None, min_length=1, max_length=128)
    max_attempts: int | None = Field(default=None, ge=1, le=1_000_000)


class HeartbeatRequest(BaseModel):
    model_config = _FINITE
    worker: Text = _Text
    lease_seconds: float | None = Field(default=None, gt=0, le=86_400)


class FinishRequest(BaseModel):
    model_config = _FINITE
    worker: Text = _Text
    status: Literal["done", "failed"]
    error: Text | None = Field(default=None, max_length=100_000)


class JobOut(BaseModel):
    model_config = _OUT
    id: int
    status: str
    priority: int
    problem_key: str
    problem: dict[str, Any]
    device_key: str
    device: dict[str, Any]
    params: dict[str, Any]
    worker: str | None
    lease_expires_at: datetime | None
    attempts: int
    error: str | None
    created_at: datetime
    updated_at: datetime

    @classmethod
    def of(cls, r: JobRecord) -> JobOut:
        return cls(id=r.id, status=r.status, priority=r.priority, problem_key=r.problem_key,
                   problem=r.problem, device_key=r.device_key, device=r.device, params=r.params,
                   worker=r.worker, lease_expires_at=r.lease_expires_at, attempts=r.attempts,
                   error=r.error, created_at=r.created_at, updated_at=r.updated_at)


class ClaimResponse(BaseModel):
    """``job`` is null when nothing is claimable."""

    model_config = _OUT
    job: JobOut | None


class JobPage(BaseModel):
    model_config = _OUT
    items: list[JobOut]
    total: int
    offset: int
    limit: int
    next_offset: int | None


# -- demand ----------------------------------------------------------------------------------------

class DemandOut(BaseModel):
    model_config = _OUT
    id: int
    device_key: str
    device: dict[str, Any]
    problem_key: str
    problem: dict[str, Any]
    count: int
    first_seen: datetime
    last_seen: datetime

    @classmethod
    def of(cls, r: DemandRecord) -> DemandOut:
        return cls(id=r.id, device_key=r.device_key, device=r.device, problem_key=r.problem_key,
                   problem=r.problem, count=r.count, first_seen=r.first_seen, last_seen=r.last_seen)


class DemandPage(BaseModel):
    """Most-missed first. ``next_offset`` is null when this page was not full."""

    model_config = _OUT
    items: list[DemandOut]
    offset: int
    limit: int
    next_offset: int | None


# -- snapshot --------------------------------------------------------------------------------------

SNAPSHOT_FORMAT = "autotuner-snapshot"
SNAPSHOT_VERSION = 1


class SnapshotEntry(BaseModel):
    model_config = _OUT
    device_key: str
    problem_key: str
    strategy: dict[str, Any]
    strategy_key: str
    speedup: float
    confidence: tuple[float, float] | None
    record_id: int
    measured_at: datetime
    trials: int


class Snapshot(BaseModel):
    """Every stored winner (of one device, or of all): what ``autotuner.runtime.client.Client(offline=
    FILE)`` reads. Only exact (``tuned``) answers; misses fall back to the baseline."""

    model_config = _OUT
    format: Literal["autotuner-snapshot"] = SNAPSHOT_FORMAT
    version: int = SNAPSHOT_VERSION
    exported_at: datetime
    devices: list[DeviceOut]
    entries: list[SnapshotEntry]


# -- health ----------------------------------------------------------------------------------------

class Health(BaseModel):
    model_config = _OUT
    status: Literal["ok", "unavailable"]
    database: str
    dialect: str
    version: str

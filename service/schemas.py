"""The API's request and response models (pydantic v2), apart from the ORM models.

Requests carry domain objects through :mod:`service.field_types` (validated by the domain code).
A response that shows a stored record (``DeviceOut``, ``ProblemOut``, ``WinnerOut``,
``MeasurementOut``, ``JobOut``, ``DemandOut``) and the upload of a measurement
(``MeasurementIn``) are derived from the record's field list in :mod:`db.records`, never
copied: a field added there is served and accepted here without a change to this module.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any, Literal, Self, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from autotuner import snapshot
from autotuner.rule import MEASUREMENT_SOURCES
from db import (
    DemandRecord,
    DeviceRecord,
    JobRecord,
    MeasurementRecord,
    ModelBenchRecord,
    ProblemRecord,
    WinnerRecord,
)
from db.fields import Spec, fields_of
from db.records import MEASUREMENT_INPUT_FIELDS
from service.field_types import DeviceField, JsonObject, ProblemField, StrategyField, Text

Source = Literal["tuned", "estimated", "nearest", "model", "default"]  # autotuner.rule.SOURCES
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
    """The strategy to use for one problem on one device, and the evidence behind it: the wire
    schema (OpenAPI) of :class:`autotuner.answer.Answer`, whose fields it carries by the same
    names (but its ``origin``; its strategy as JSON, with ``strategy_key``). The lookup route
    builds it from an Answer (``service.lookups.lookup_of``); the client reads it back as one.

    ``source``: ``tuned`` (this exact problem was measured on this device), ``nearest``
    (the winner of the closest tuned shape of the same pattern, dtype and mesh size on this
    device; ``distance`` is the log2-shape distance to it, ``neighbor_key`` its key),
    ``model`` (a cost model's prediction) or ``default`` (the baseline: nothing known).
    ``speedup`` is baseline time / strategy time as measured (for ``nearest``: on the
    neighbour), ``confidence`` its interval ``[lo, hi]`` where one was measured.
    ``record_id`` is the winner record's id, ``measured_at`` when it last changed.
    ``traffic_speedup`` x ``overlap_speedup`` split a measured ring's speedup by its serial
    control (the same ring, nothing overlapped) timed beside it: what moving less saves, and
    what running the transfers beside the einsums adds (null where not split).
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
    traffic_speedup: float | None = None
    overlap_speedup: float | None = None
    problem_key: str
    device_key: str


class LookupBatch(BaseModel):
    model_config = _OUT
    device_key: str
    results: list[Lookup]


# -- records ---------------------------------------------------------------------------------------

class RecordOut(BaseModel):
    """A response that shows a db record; :meth:`of` builds it from one (and so does
    validation from attributes, as when a record is nested in another response)."""

    model_config = ConfigDict(frozen=True, from_attributes=True)

    @classmethod
    def of(cls, record: Any, **extra: Any) -> Self:
        """The record's fields that this model shows, and ``extra`` values."""
        values = {name: getattr(record, name) for name in cls.model_fields if name not in extra}
        return cls.model_validate({**values, **extra})


def record_out(record: type, *, drop: tuple[str, ...] = (),
               after: dict[str, dict[str, Any]] | None = None, name: str | None = None) -> type[RecordOut]:
    """The response model of ``record`` (a dataclass), named ``name`` or ``{Record}Out`` without
    "Record": its fields in its order and types, but ``drop``; ``after`` inserts ``{name: type}``
    after a field."""
    hints = get_type_hints(record)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(record):
        if f.name not in drop:
            fields[f.name] = (hints[f.name], ...)
        for name, hint in (after or {}).get(f.name, {}).items():
            fields[name] = (hint, ...)
    name = name or record.__name__.removesuffix("Record") + "Out"
    return create_model(name, __base__=RecordOut, __module__=__name__, **fields)


DeviceOut = record_out(DeviceRecord)
ProblemOut = record_out(ProblemRecord)
WinnerOut = record_out(WinnerRecord, drop=("device_id", "problem_id"),
                       after={"traffic_speedup": {"overlap_speedup": float | None}})
MeasurementOut = record_out(MeasurementRecord, after={"device_id": {"device_key": str | None}})


class ProblemRowOut(BaseModel):
    model_config = ConfigDict(frozen=True, from_attributes=True)  # model_validate(a ProblemRow)
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

MAX_LIST = 100_000  # items of an uploaded list (samples)
MAX_COUNT = 10_000_000  # an uploaded count (n)


class _MeasurementUpload(BaseModel):
    model_config = _FINITE
    strategy: StrategyField
    strategy_key: Text | None = Field(
        default=None, max_length=fields_of(MeasurementRecord, ("strategy_key",))["strategy_key"].max_len)
    status: Literal["ok", "failed"]

    @model_validator(mode="after")
    def _a_source(self) -> Self:
        """`source` (derived from the record, below): who measured it, one of MEASUREMENT_SOURCES
        (omitted: tuned; an in-job token uploads in-job ones only)."""
        if getattr(self, "source", None) not in (None, *MEASUREMENT_SOURCES):
            raise ValueError(f"source must be one of {', '.join(MEASUREMENT_SOURCES)}")
        return self

    @model_validator(mode="after")
    def _ok_has_median(self) -> Self:
        if self.status == "ok" and getattr(self, "median_s", None) is None:
            raise ValueError('an "ok" measurement needs median_s')
        return self


def _upload_field(spec: Spec) -> Any:
    """A measurement field as an upload accepts it: optional, numbers >= 0, text as stored."""
    if spec.kind is float:
        return float | None, Field(default=None, ge=0)
    if spec.kind is int:
        return int | None, Field(default=None, ge=spec.minimum or 0, le=MAX_COUNT)
    if spec.kind is str:
        return Text | None, Field(default=None, max_length=spec.max_len)
    if spec.kind is dict:
        return JsonObject | None, None
    if spec.kind is tuple:
        (item, *_) = spec.hint.__args__
        return list[item], Field(default_factory=list, max_length=MAX_LIST)
    raise TypeError(f"no upload form for {spec.hint!r}")


MeasurementIn = create_model(
    "MeasurementIn",
    __base__=_MeasurementUpload,
    __module__=__name__,
    __doc__="""One timed strategy (see ``db.MeasurementInput``); ``ratio`` = baseline time / this time
    with its confidence interval ``ratio_lo``..``ratio_hi``. ``strategy_key`` is derived from
    ``strategy``; if given it must match.""",
    **{name: _upload_field(spec) for name, spec in fields_of(MeasurementRecord, MEASUREMENT_INPUT_FIELDS).items()
       if name not in _MeasurementUpload.model_fields and name != "created_at"},
)


class ResultsRequest(BaseModel):
    """Measurements of one problem on one device; the winner is recomputed in the same
    transaction."""

    model_config = _FINITE
    device: DeviceField
    problem: ProblemField
    measurements: list[MeasurementIn] = Field(min_length=1, max_length=10_000)
    name: str | None = Field(default=None, max_length=256,
                             description="a readable label for the problem (e.g. the model's layer), "
                                         "shown by the dashboard; kept when omitted")


class ResultsResponse(BaseModel):
    model_config = _OUT
    device_key: str
    problem_key: str
    recorded: int
    repeated: int
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
    max_attempts: int | None = Field(
        default=None, ge=1, le=1_000_000,
        description="claim only jobs claimed fewer times; a running job whose lease ran out after this many "
                    "claims (its workers died or hung each time) is failed, and listed in `abandoned`")


class HeartbeatRequest(BaseModel):
    model_config = _FINITE
    worker: Text = _Text
    lease_seconds: float | None = Field(default=None, gt=0, le=86_400)


class FinishRequest(BaseModel):
    model_config = _FINITE
    worker: Text = _Text
    status: Literal["done", "failed"]
    error: Text | None = Field(default=None, max_length=100_000)


class ReleaseRequest(BaseModel):
    model_config = _FINITE
    worker: Text = _Text


class CancelRequest(BaseModel):
    """Why the job is cancelled (kept in its error after ``cancelled: ``)."""

    model_config = _FINITE
    reason: Text | None = Field(default=None, max_length=10_000)


class RetryRequest(BaseModel):
    """Queue a job's (device, problem) again; ``params`` and ``priority`` default to the job's."""

    model_config = _FINITE
    params: JsonObject | None = None
    priority: int | None = Field(default=None, ge=-1_000_000, le=1_000_000)


class DemandJobsRequest(BaseModel):
    """Queue jobs for the problems lookups missed most on one device."""

    model_config = _FINITE
    device_key: Text = Field(min_length=1, max_length=128)
    limit: int = Field(default=10, ge=1, le=1000)
    min_count: int = Field(default=1, ge=1, le=2**31 - 1)
    params: JsonObject = Field(default_factory=dict)
    priority: int = Field(default=0, ge=-1_000_000, le=1_000_000)


JobOut = record_out(JobRecord)


class ClaimResponse(BaseModel):
    """``job`` is null when nothing is claimable. ``abandoned``: the jobs this claim failed,
    with ``max_attempts``, because their lease ran out after their last allowed claim."""

    model_config = _OUT
    job: JobOut | None
    abandoned: list[JobOut] = []


class JobList(BaseModel):
    model_config = _OUT
    items: list[JobOut]


class JobPage(BaseModel):
    model_config = _OUT
    items: list[JobOut]
    total: int
    offset: int
    limit: int
    next_offset: int | None


# -- model benches (bench-model runs) --------------------------------------------------------------

ModelBenchOut = record_out(ModelBenchRecord, drop=("device_id",))


# -- demand ----------------------------------------------------------------------------------------

DemandOut = record_out(DemandRecord)


class DemandPage(BaseModel):
    """Most-missed first. ``next_offset`` is null when this page was not full."""

    model_config = _OUT
    items: list[DemandOut]
    offset: int
    limit: int
    next_offset: int | None


# -- snapshot --------------------------------------------------------------------------------------

# a stored winner as a snapshot lists it (`autotuner.snapshot.Entry`: the fields and their order)
SnapshotEntry = record_out(snapshot.Entry, name="SnapshotEntry")


class Snapshot(BaseModel):
    """Every stored winner (of one device, or of all): what ``autotuner.runtime.client.Client(offline=
    FILE)`` reads. Only exact (``tuned``) answers; misses fall back to the baseline. The format
    is :mod:`autotuner.snapshot`'s."""

    model_config = _OUT
    format: Literal[snapshot.FORMAT] = snapshot.FORMAT
    version: int = snapshot.VERSION
    exported_at: datetime
    devices: list[DeviceOut]
    entries: list[SnapshotEntry]
    evidence: list[dict[str, Any]] = []   # in-program evidence in use (`autotuner.snapshot.evidence_json`)


# -- health ----------------------------------------------------------------------------------------

class Health(BaseModel):
    model_config = _OUT
    status: Literal["ok", "unavailable"]
    database: str
    dialect: str
    version: str

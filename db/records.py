"""Immutable records the repository returns: plain values, never ORM rows.

Records are frozen dataclasses, detached from any session, safe to keep after the session
closes and to share between threads. JSON lists come back as tuples; JSON objects come back
as fresh ``dict`` copies (changing one never changes the database; treat them as read-only).
Timestamps are timezone-aware UTC.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, NamedTuple, NotRequired, TypedDict, TypeVar

__all__ = [
    "CalibrationRecord",
    "DemandRecord",
    "DeviceRecord",
    "JobRecord",
    "MeasurementInput",
    "MeasurementRecord",
    "Neighbor",
    "Page",
    "ProblemRecord",
    "ProblemRow",
    "TokenRecord",
    "WinnerChoice",
    "WinnerRecord",
]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Page(Generic[T]):
    """One page of a listing: ``items[0]`` is row ``offset`` of ``total`` matching rows."""

    items: tuple[T, ...]
    total: int
    offset: int
    limit: int

    @property
    def has_more(self) -> bool:
        return self.offset + len(self.items) < self.total


@dataclass(frozen=True, slots=True)
class DeviceRecord:
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


@dataclass(frozen=True, slots=True)
class ProblemRecord:
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


class MeasurementInput(TypedDict):
    """One item of :func:`db.repository.record_measurements`.

    ``strategy`` must have a ``"method"`` (``"baseline"`` for the plain collective + einsum).
    ``ratio`` is baseline time / this time and ``ratio_lo``/``ratio_hi`` its confidence
    interval, as computed by the caller (``autotuner.measure``). An ``"ok"`` item needs
    ``median_s``; a ``"failed"`` one should say why in ``reason``.
    """

    strategy: dict[str, Any]
    strategy_key: str
    status: str
    reason: NotRequired[str | None]
    samples: NotRequired[list[float]]
    median_s: NotRequired[float | None]
    iqr_s: NotRequired[float | None]
    min_s: NotRequired[float | None]
    n: NotRequired[int]
    ratio: NotRequired[float | None]
    ratio_lo: NotRequired[float | None]
    ratio_hi: NotRequired[float | None]
    compile_s: NotRequired[float | None]
    memory: NotRequired[dict[str, Any] | None]
    run_id: NotRequired[str | None]
    host: NotRequired[str | None]
    created_at: NotRequired[datetime]


@dataclass(frozen=True, slots=True)
class MeasurementRecord:
    id: int
    problem_id: int
    device_id: int
    strategy: dict[str, Any]
    strategy_key: str
    method: str
    status: str
    reason: str | None
    samples: tuple[float, ...]
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


@dataclass(frozen=True, slots=True)
class WinnerChoice:
    """What :func:`db.repository.choose_winner` decides, before it is stored.

    ``measurement_id`` is the winning measurement (``None`` if a custom rule has none);
    ``measurement_ids`` the evidence: the latest measurement of every strategy; ``trials``
    the number of measurements considered (failed ones included).
    """

    strategy: dict[str, Any]
    strategy_key: str
    method: str
    speedup: float
    speedup_lo: float | None
    speedup_hi: float | None
    baseline_s: float | None
    winner_s: float | None
    measurement_id: int | None
    measurement_ids: tuple[int, ...]
    trials: int


@dataclass(frozen=True, slots=True)
class WinnerRecord:
    id: int
    device_id: int
    problem_id: int
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
    measurement_ids: tuple[int, ...]
    trials: int
    created_at: datetime
    updated_at: datetime


class Neighbor(NamedTuple):
    """A result of :func:`db.repository.nearest_winners`; unpacks as ``(winner, problem, d)``.

    ``distance`` is the Euclidean distance over log2 of (m, n, k, b).
    """

    winner: WinnerRecord
    problem: ProblemRecord
    distance: float


@dataclass(frozen=True, slots=True)
class ProblemRow:
    """A row of :func:`db.repository.list_problems`: a problem and, if tuned, one device's
    winner (``device`` and ``winner`` are both ``None`` for a problem without a winner)."""

    problem: ProblemRecord
    device: DeviceRecord | None
    winner: WinnerRecord | None


@dataclass(frozen=True, slots=True)
class JobRecord:
    id: int
    problem_key: str
    problem: dict[str, Any]
    device_key: str
    device: dict[str, Any]
    status: str
    priority: int
    params: dict[str, Any]
    worker: str | None
    lease_expires_at: datetime | None
    attempts: int
    error: str | None
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class DemandRecord:
    id: int
    device_key: str
    device: dict[str, Any]
    problem_key: str
    problem: dict[str, Any]
    count: int
    first_seen: datetime
    last_seen: datetime


@dataclass(frozen=True, slots=True)
class TokenRecord:
    """An API token's metadata; the token itself is never stored or returned."""

    id: int
    name: str
    scope: str
    created_at: datetime
    revoked_at: datetime | None


@dataclass(frozen=True, slots=True)
class CalibrationRecord:
    """One stored calibration of a device's cost model (``params`` is the model's own JSON)."""

    id: int
    device_id: int
    device_key: str
    model: str
    params: dict[str, Any]
    raw: dict[str, Any] | None
    host: str | None
    created_at: datetime

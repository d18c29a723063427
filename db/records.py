"""Immutable records the repository returns: plain values, never ORM rows.

Records are frozen dataclasses, detached from any session, safe to keep after the session
closes and to share between threads. JSON lists come back as tuples; JSON objects come back
as fresh ``dict`` copies (changing one never changes the database; treat them as read-only).
Timestamps are timezone-aware UTC.

Each record's field list is written here once, and everything else is derived from it (see
:mod:`db.fields`): the ORM columns (:mod:`db.tables`), the row -> record conversion and the
checks on write (the repository), :class:`MeasurementInput`, and the service's response and
upload models (:mod:`service.schemas`). Adding a field to a record is this file plus a
migration.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, NamedTuple, NotRequired, TypedDict, TypeVar, get_type_hints

from autotuner.measurement import MEASUREMENT_FIELDS, measurement_item, overlap_speedup
from db.fields import KEY_LEN, at_least, joined, long_text, signed, text

__all__ = [
    "MEASUREMENT_INPUT_FIELDS",
    "CalibrationRecord",
    "DemandRecord",
    "DeviceRecord",
    "EvidenceRecord",
    "FailureRecord",
    "JobRecord",
    "MeasurementInput",
    "MeasurementRecord",
    "ModelBenchRecord",
    "Neighbor",
    "Page",
    "ProblemRecord",
    "ProblemRow",
    "TokenRecord",
    "WinnerChoice",
    "WinnerRecord",
    "measurement_input",
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
    key: str = text(KEY_LEN)
    platform: str = text(32)
    device_kind: str = text(128)
    num_devices: int = at_least(1)
    num_processes: int = at_least(1)
    topology: str | None = text(128)
    jax_version: str = text(32)
    jaxlib_version: str = text(32)
    created_at: datetime


@dataclass(frozen=True, slots=True)
class ProblemRecord:
    """A stored problem: ``canonical`` is ``autotuner.Problem``'s canonical dict, ``key`` its
    hash, ``pattern`` e.g. ``"all_gather:lhs:free"``, ``mesh_size`` the size of the
    collective's axis; ``m, n, k, b`` (``b`` the batch) its matmul extents, which
    nearest-shape queries use, and ``flops``/``comm_bytes`` its size. Numbers are >= 0."""

    id: int
    key: str = text(KEY_LEN)
    canonical: dict[str, Any]
    equation: str = text(256)
    pattern: str = text(64)
    dtype: str = text(32)
    mesh_size: int = at_least(1)
    m: float
    n: float
    k: float
    b: float
    flops: float
    comm_bytes: float
    name: str | None = text(256)
    created_at: datetime


@dataclass(frozen=True, slots=True)
class MeasurementRecord:
    """One timed strategy of one problem on one device (a tuning trial); never changes.

    ``method`` is ``strategy["method"]``; ``status`` ``"ok"`` or ``"failed"`` (then
    ``reason`` says why). Every number is a time in seconds or a ratio of times (``ratio`` is
    baseline time / this time, ``ratio_lo``/``ratio_hi`` its confidence interval): >= 0.
    ``aa_width`` is the noise floor of the session that measured it: how far from 1.0 the ratio
    CI of the baseline timed against a second copy of itself reached (an A/A check; ``None``
    when the session had none). A ratio closer to 1 than that is indistinguishable from noise.
    ``serial_s`` and ``traffic_speedup`` split a ring's ratio where its serial control (the same
    ring, nothing overlapped) was timed in the same session: the control's median, and its ratio
    (reference / control); ``ratio / traffic_speedup`` is what overlap adds. ``None`` otherwise.
    Provenance (issue 38): ``source`` who measured it (``autotuner.rule.MEASUREMENT_SOURCES``:
    ``tuned`` or ``in-job``; ``None`` on rows stored before it was recorded, read as ``tuned``),
    ``host`` where, ``token_id`` the stored token that uploaded it (``None``: a settings token,
    or written straight to the database by ``autotuner tune --db``); ``n`` and the interval are its
    strength.
    """

    id: int
    problem_id: int
    device_id: int
    strategy: dict[str, Any]
    strategy_key: str = text(256)
    method: str = text(64)
    status: str = text(16)
    reason: str | None = long_text()
    samples: tuple[float, ...]
    median_s: float | None
    iqr_s: float | None
    min_s: float | None
    n: int
    ratio: float | None
    ratio_lo: float | None
    ratio_hi: float | None
    aa_width: float | None
    compile_s: float | None
    memory: dict[str, Any] | None
    run_id: str | None = text(64)
    host: str | None = text(256)
    serial_s: float | None
    traffic_speedup: float | None
    source: str | None = text(16)
    token_id: int | None
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
    serial_s: float | None = None
    traffic_speedup: float | None = None


@dataclass(frozen=True, slots=True)
class WinnerRecord:
    """The current best strategy of one problem on one device (see :mod:`db.apply_rule`);
    ``serial_s``/``traffic_speedup`` its winning measurement's split (``None`` where it has none)."""

    id: int
    device_id: int
    problem_id: int
    device_key: str = joined()
    problem_key: str = joined()
    strategy: dict[str, Any]
    strategy_key: str = text(256)
    method: str = text(64)
    speedup: float
    speedup_lo: float | None
    speedup_hi: float | None
    baseline_s: float | None
    winner_s: float | None
    measurement_ids: tuple[int, ...]
    trials: int
    serial_s: float | None
    traffic_speedup: float | None
    created_at: datetime
    updated_at: datetime

    @property
    def overlap_speedup(self) -> float | None:
        """The winner's speedup over its traffic part (see `autotuner.measurement.overlap_speedup`)."""
        return overlap_speedup(self.speedup, self.traffic_speedup)


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
class FailureRecord:
    """A problem that could not be tuned on a device: its harness raised, or every candidate
    (the baseline included) failed. ``error`` says why (one line first), ``name`` is the label
    the tuning run gave the problem. One per (device, problem), the latest failure; removed when
    the problem is tuned there."""

    id: int
    device_id: int
    problem_id: int
    device_key: str = joined()
    problem_key: str = joined()
    name: str | None = text(256)
    error: str = long_text()
    run_id: str | None = text(64)
    host: str | None = text(256)
    created_at: datetime


@dataclass(frozen=True, slots=True)
class JobRecord:
    """A request to tune one problem (canonical JSON) on one device (fingerprint JSON)."""

    id: int
    status: str = text(16)
    priority: int
    problem_key: str = text(KEY_LEN)
    problem: dict[str, Any]
    device_key: str = text(KEY_LEN)
    device: dict[str, Any]
    params: dict[str, Any]
    worker: str | None = text(256)
    lease_expires_at: datetime | None
    attempts: int
    error: str | None = long_text()
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class DemandRecord:
    """Lookup misses of one (device, problem): how often it was asked for but not tuned."""

    id: int
    device_key: str = text(KEY_LEN)
    device: dict[str, Any]
    problem_key: str = text(KEY_LEN)
    problem: dict[str, Any]
    count: int
    first_seen: datetime
    last_seen: datetime


@dataclass(frozen=True, slots=True)
class TokenRecord:
    """An API token's metadata; the token itself is never stored or returned."""

    id: int
    name: str = text(128)
    scope: str = text(8)
    created_at: datetime
    revoked_at: datetime | None


@dataclass(frozen=True, slots=True)
class CalibrationRecord:
    """One stored calibration of a device's cost model (``params`` is the model's own JSON)."""

    id: int
    device_id: int
    device_key: str = joined()
    model: str = text(64)
    params: dict[str, Any]
    raw: dict[str, Any] | None
    host: str | None = text(256)
    created_at: datetime


@dataclass(frozen=True, slots=True)
class ModelBenchRecord:
    """One ``autotuner bench-model`` run: a program's step, plain ``jax.jit`` against
    ``autotuner.overlap(fn)``, timed interleaved on one target. Never changes.

    ``program`` is ``MODULE:FACTORY`` and ``kwargs`` the factory's keyword arguments; ``mesh``
    the ``--mesh`` axes (``None``: the factory's own); ``strategy`` what was asked for
    (``auto``, ``baseline`` or one strategy's key). ``plain_s``/``overlapped_s`` are the
    medians per step (seconds) with their 95% intervals (``_lo_s``/``_hi_s``); ``speedup`` is
    plain / overlapped with its interval; ``slower`` flags an overlapped step slower than plain
    beyond the interval. ``pairs`` is the per-pair breakdown as bench-model prints it (each
    distinct problem and strategy timed alone: ``key``, ``strategy``, ``count``, ``names``,
    ``baseline_s``, ``strategy_s``, ``comm_s``, ``comp_s``, ``ratio``..., ``saved_s``,
    ``failed``); ``comm_s`` the collectives alone per step (all pairs), ``decomposed_comm_s``
    those of the decomposed pairs, ``predicted_saved_s`` the saving the pairs alone predict
    (negative: a loss). ``rel_error`` is overlapped vs plain's relative difference.
    """

    id: int
    device_id: int
    device_key: str = joined()
    program: str = text(512)
    kwargs: dict[str, Any]
    target: str = text(256)
    mesh: dict[str, Any] | None
    strategy: str = text(256)
    reps: int = at_least(1)
    plain_s: float
    plain_lo_s: float | None
    plain_hi_s: float | None
    overlapped_s: float
    overlapped_lo_s: float | None
    overlapped_hi_s: float | None
    speedup: float
    speedup_lo: float | None
    speedup_hi: float | None
    slower: bool
    rel_error: float | None
    pairs: tuple[dict[str, Any], ...]
    comm_s: float | None
    decomposed_comm_s: float | None
    predicted_saved_s: float | None = signed()
    host: str | None = text(256)
    created_at: datetime
    attribution: tuple[dict[str, Any], ...] | None = None

    @property
    def measured_saved_s(self) -> float:
        """Seconds saved per step as measured: plain median - overlapped median (negative: lost)."""
        return self.plain_s - self.overlapped_s

    @property
    def comm_share(self) -> float | None:
        """The collectives' share of the plain step (``comm_s / plain_s``), if timed."""
        return None if self.comm_s is None or not self.plain_s else self.comm_s / self.plain_s


# -- measurement items ---------------------------------------------------------------------------

# What a caller gives for a measurement: the record's fields but those the database sets (ids,
# and ``method``, which is ``strategy["method"]``). ``created_at`` is optional (default: now).
_NOT_INPUT = ("id", "problem_id", "device_id", "method", "token_id")   # token_id: the writer's, set by the store
_REQUIRED_INPUT = ("strategy", "strategy_key", "status")
MEASUREMENT_INPUT_FIELDS = tuple(
    f.name for f in dataclasses.fields(MeasurementRecord) if f.name not in _NOT_INPUT)
if set(MEASUREMENT_INPUT_FIELDS) != set(MEASUREMENT_FIELDS):   # the core's list is the one a caller builds
    raise ImportError(f"db.records.MeasurementRecord's input fields {MEASUREMENT_INPUT_FIELDS} are not "
                      f"autotuner.measurement.MEASUREMENT_FIELDS {MEASUREMENT_FIELDS}")

MeasurementInput = TypedDict(  # type: ignore[misc]  # built from MeasurementRecord
    "MeasurementInput",
    {name: hint if name in _REQUIRED_INPUT else NotRequired[hint]
     for name, hint in get_type_hints(MeasurementRecord).items() if name not in _NOT_INPUT},
)
MeasurementInput.__doc__ = """One item of :func:`db.repository.record_measurements`: the fields
of :class:`MeasurementRecord` but ``id``, ``problem_id``, ``device_id`` and ``method``.

``strategy`` must have a ``"method"`` (``"baseline"`` for the plain collective + einsum).
``ratio`` is baseline time / this time and ``ratio_lo``/``ratio_hi`` its confidence
interval, as computed by the caller (``autotuner.measure``). An ``"ok"`` item needs
``median_s``; a ``"failed"`` one should say why in ``reason``. ``strategy``, ``strategy_key``
and ``status`` are required; ``created_at`` defaults to the time of writing.
"""


def measurement_input(of: Any, /, **given: Any) -> MeasurementInput:
    """The :class:`MeasurementInput` of ``of`` (`autotuner.measurement.measurement_item`, the
    one place a measurement's item is built; here typed as the database takes it)."""
    return measurement_item(of, **given)  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class EvidenceRecord:
    """What a whole program's step said about one problem's choice on one device
    (``autotuner tune-model``'s refinement); append-only, the newest row of a (device, program,
    problem) is the evidence in use.

    ``program_key`` is ``autotuner.overlap.plan.program_key`` of the program it was measured in
    (its problems and their counts, hashed) and ``program`` what was run (``MODULE:FACTORY`` and
    its keyword arguments, for people). ``strategy`` is the choice kept, ``previous`` the choice
    refinement started from (the isolated winner's plan); ``speedup`` is the step with
    ``previous`` over the step with the best candidate tried, with its 95% interval
    (``speedup_lo``/``speedup_hi``), over ``reps`` interleaved repetitions (0: nothing to try);
    ``tried`` each candidate: ``strategy_key``, ``speedup``, ``speedup_lo``, ``speedup_hi``."""

    id: int
    device_id: int
    device_key: str = joined()
    program_key: str = text(64)
    program: str = text(1024)
    problem_key: str = text(KEY_LEN)
    name: str | None = text(512)
    strategy: dict[str, Any]
    strategy_key: str = text(256)
    previous: dict[str, Any]
    previous_key: str = text(256)
    speedup: float | None
    speedup_lo: float | None
    speedup_hi: float | None
    reps: int
    tried: tuple[dict[str, Any], ...]
    created_at: datetime

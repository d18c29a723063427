"""SQLAlchemy 2.0 ORM models (typed ``Mapped`` columns) of the results database.

These are private to :mod:`db`: the repository returns frozen records (:mod:`db.records`),
never these rows. The schema is created and changed only by the Alembic migrations in
``db/migrations`` (``autotuner db upgrade``); nothing in production calls ``create_all``.

Conventions: every constraint and index is named (``NAMING_CONVENTION``) so migrations can
refer to them on every backend; timestamps are timezone-aware UTC (:class:`UTCDateTime`);
JSON payloads use the generic :class:`sqlalchemy.JSON` type (JSON on PostgreSQL, TEXT on
SQLite).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    CheckConstraint,
    DateTime,
    Double,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

__all__ = [
    "JOB_STATUSES",
    "MEASUREMENT_STATUSES",
    "NAMING_CONVENTION",
    "TOKEN_SCOPES",
    "Base",
    "Calibration",
    "Demand",
    "Device",
    "Measurement",
    "Problem",
    "Token",
    "TuningJob",
    "UTCDateTime",
    "Winner",
    "utcnow",
]

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

MEASUREMENT_STATUSES = ("ok", "failed")
JOB_STATUSES = ("queued", "running", "done", "failed")
TOKEN_SCOPES = ("read", "write")

KEY_LEN = 128


def utcnow() -> datetime:
    """The current time, timezone-aware, in UTC."""
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp stored in UTC and always returned timezone-aware (UTC).

    PostgreSQL stores ``timestamptz``; SQLite stores naive UTC text, which sorts and compares
    correctly because every value is converted to UTC before it is bound. A naive datetime
    passed in is taken to be UTC already.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        value = value.astimezone(UTC)
        if dialect.name == "sqlite":
            return value.replace(tzinfo=None)
        return value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {
        datetime: UTCDateTime(),
        dict[str, Any]: JSON(),
        list[Any]: JSON(),
        float: Double(),
    }


class Device(Base):
    """A device fingerprint (``autotuner.Device``); ``key`` is computed by the caller."""

    __tablename__ = "devices"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    key: Mapped[str] = mapped_column(String(KEY_LEN), unique=True)
    platform: Mapped[str] = mapped_column(String(32))
    device_kind: Mapped[str] = mapped_column(String(128))
    num_devices: Mapped[int]
    num_processes: Mapped[int]
    topology: Mapped[str | None] = mapped_column(String(128))
    jax_version: Mapped[str] = mapped_column(String(32))
    jaxlib_version: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Problem(Base):
    """A sharded einsum (``autotuner.Problem``) and the features nearest-shape queries use.

    ``m, n, k, b`` are the problem's matmul extents as the caller defines them; ``lm, ln, lk,
    lb`` are their log2 (values below 1 count as 1), stored at insert time so the distance
    can be computed in SQL on every backend.
    """

    __tablename__ = "problems"
    # nearest-shape queries (repository.nearest_winners): the group, a range on lm, and the
    # other log features so the distance is computed from the index alone
    __table_args__ = (Index("ix_problems_nearest", "pattern", "dtype", "mesh_size", "lm", "ln", "lk", "lb"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    key: Mapped[str] = mapped_column(String(KEY_LEN), unique=True)
    canonical: Mapped[dict[str, Any]]
    equation: Mapped[str] = mapped_column(String(256))
    pattern: Mapped[str] = mapped_column(String(64))
    dtype: Mapped[str] = mapped_column(String(32))
    mesh_size: Mapped[int]
    m: Mapped[float]
    n: Mapped[float]
    k: Mapped[float]
    b: Mapped[float]
    flops: Mapped[float]
    comm_bytes: Mapped[float]
    lm: Mapped[float]
    ln: Mapped[float]
    lk: Mapped[float]
    lb: Mapped[float]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Measurement(Base):
    """One timed strategy of one problem on one device (a tuning trial)."""

    __tablename__ = "measurements"
    __table_args__ = (
        Index(None, "device_id", "problem_id"),
        Index(None, "problem_id"),
        CheckConstraint(_in("status", MEASUREMENT_STATUSES), name="status"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    problem_id: Mapped[int] = mapped_column(ForeignKey("problems.id", ondelete="CASCADE"))
    device_id: Mapped[int] = mapped_column(ForeignKey("devices.id", ondelete="CASCADE"))
    strategy: Mapped[dict[str, Any]]
    strategy_key: Mapped[str] = mapped_column(String(256))
    method: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text)
    samples: Mapped[list[Any]]
    median_s: Mapped[float | None]
    iqr_s: Mapped[float | None]
    min_s: Mapped[float | None]
    n: Mapped[int] = mapped_column(default=0)
    ratio: Mapped[float | None]
    ratio_lo: Mapped[float | None]
    ratio_hi: Mapped[float | None]
    compile_s: Mapped[float | None]
    memory: Mapped[dict[str, Any] | None]
    run_id: Mapped[str | None] = mapped_column(String(64))
    host: Mapped[str | None] = mapped_column(String(256))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Winner(Base):
    """The current best strategy of one problem on one device, derived from measurements."""

    __tablename__ = "winners"
    __table_args__ = (UniqueConstraint("device_id", "problem_id"), Index(None, "problem_id"))

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    device_id: Mapped[int] = mapped_column(ForeignKey("devices.id", ondelete="CASCADE"))
    problem_id: Mapped[int] = mapped_column(ForeignKey("problems.id", ondelete="CASCADE"))
    strategy: Mapped[dict[str, Any]]
    strategy_key: Mapped[str] = mapped_column(String(256))
    method: Mapped[str] = mapped_column(String(64), index=True)
    speedup: Mapped[float]
    speedup_lo: Mapped[float | None]
    speedup_hi: Mapped[float | None]
    baseline_s: Mapped[float | None]
    winner_s: Mapped[float | None]
    measurement_ids: Mapped[list[Any]]
    trials: Mapped[int]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)


class TuningJob(Base):
    """A request to tune one problem on one device, claimed by workers under a lease.

    The problem and device travel as JSON (with their keys) so a job can exist before the
    problem has been measured anywhere. At most one job per (device, problem) is active
    (queued or running): a partial unique index enforces it.
    """

    __tablename__ = "tuning_jobs"
    __table_args__ = (
        CheckConstraint(_in("status", JOB_STATUSES), name="status"),
        Index(None, "status", "priority", "created_at"),
        Index(
            "uq_tuning_jobs_active",
            "device_key",
            "problem_key",
            unique=True,
            sqlite_where=text("status IN ('queued', 'running')"),
            postgresql_where=text("status IN ('queued', 'running')"),
        ),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    problem_key: Mapped[str] = mapped_column(String(KEY_LEN))
    problem: Mapped[dict[str, Any]]
    device_key: Mapped[str] = mapped_column(String(KEY_LEN))
    device: Mapped[dict[str, Any]]
    status: Mapped[str] = mapped_column(String(16), default="queued")
    priority: Mapped[int] = mapped_column(default=0)
    params: Mapped[dict[str, Any]]
    worker: Mapped[str | None] = mapped_column(String(256))
    lease_expires_at: Mapped[datetime | None]
    attempts: Mapped[int] = mapped_column(default=0)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class Demand(Base):
    """Lookup misses per (device, problem): how often a shape was asked for but not tuned."""

    __tablename__ = "demand"
    __table_args__ = (UniqueConstraint("device_key", "problem_key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    device_key: Mapped[str] = mapped_column(String(KEY_LEN))
    device: Mapped[dict[str, Any]]
    problem_key: Mapped[str] = mapped_column(String(KEY_LEN))
    problem: Mapped[dict[str, Any]]
    count: Mapped[int] = mapped_column(default=1)
    first_seen: Mapped[datetime] = mapped_column(default=utcnow)
    last_seen: Mapped[datetime] = mapped_column(default=utcnow, index=True)


class Token(Base):
    """An API token; only its SHA-256 hex digest is stored."""

    __tablename__ = "tokens"
    __table_args__ = (CheckConstraint(_in("scope", TOKEN_SCOPES), name="scope"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    scope: Mapped[str] = mapped_column(String(8))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None]


class Calibration(Base):
    """A device's cost-model parameters from one calibration run (``autotuner calibrate``).

    Append-only: the newest row of a (device, model) is the calibration in use. ``params`` is
    the model's JSON (opaque here), ``raw`` optionally the measurements it was fitted on.
    """

    __tablename__ = "calibrations"
    __table_args__ = (Index(None, "device_id", "model", "created_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    device_id: Mapped[int] = mapped_column(ForeignKey("devices.id", ondelete="CASCADE"))
    model: Mapped[str] = mapped_column(String(64))
    params: Mapped[dict[str, Any]]
    raw: Mapped[dict[str, Any] | None]
    host: Mapped[str | None] = mapped_column(String(256))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

"""SQLAlchemy 2.0 ORM models (typed ``Mapped`` columns) of the results database.

These are private to :mod:`db`: the repository returns frozen records (:mod:`db.records`),
never these rows. The schema is created and changed only by the Alembic migrations in
``db/migrations`` (``autotuner db upgrade``); nothing in production calls ``create_all``.

A table's columns are its record's fields (``class Device(Base, record=DeviceRecord)``), in
the record's types: ``X | None`` is nullable, a text field is ``VARCHAR(n)`` as the record's
``text(n)`` says (``TEXT`` for ``long_text()``), a JSON list (``tuple[...]``) or object is
JSON, ``id`` is the primary key and a required timestamp defaults to now. A model spells out
only what a record cannot say: foreign keys, indexes, constraints, defaults, and columns no
record shows (a problem's log features, a token's hash); a column declared in the class body
replaces the derived one, and ``defaults={name: value}`` gives derived ones an insert default.

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
    BigInteger,
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

from autotuner.rule import MEASUREMENT_SOURCES
from db._common import utcnow
from db.fields import KEY_LEN, Spec, specs
from db.records import (
    CalibrationRecord,
    DemandRecord,
    DeviceRecord,
    EvidenceRecord,
    FailureRecord,
    JobRecord,
    MeasurementRecord,
    ModelBenchRecord,
    ProblemRecord,
    TokenRecord,
    WinnerRecord,
)

__all__ = [
    "JOB_STATUSES",
    "KEY_LEN",
    "MEASUREMENT_STATUSES",
    "NAMING_CONVENTION",
    "TOKEN_SCOPES",
    "Base",
    "Calibration",
    "Demand",
    "Device",
    "Failure",
    "Generation",
    "Measurement",
    "ModelBench",
    "Problem",
    "Token",
    "TuningJob",
    "UTCDateTime",
    "SchemaReaders",
    "StepEvidence",
    "Winner",
    "WinnerChange",
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
# read: lookups; write: everything; in-job: reads, and uploads of in-job measurements only (the token a
# training job holds for `overlap(tune="missing")`: it cannot write a tuned result nor queue work)
TOKEN_SCOPES = ("read", "write", "in-job")


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


def _column(spec: Spec, defaults: dict[str, Any]) -> tuple[Any, Any]:
    """The ``Mapped[...]`` annotation and the ``mapped_column`` of a record's field."""
    stored: Any = {tuple: list[Any], dict: dict[str, Any]}.get(spec.kind, spec.hint)
    annotation = Mapped[stored | None] if spec.optional else Mapped[stored]  # type: ignore[valid-type]
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    if spec.kind is str:
        args.append(Text() if spec.long else String(spec.max_len))
    if spec.name == "id":
        args.append(Integer())
        kwargs["primary_key"] = True
    if spec.name in defaults:
        kwargs["default"] = defaults[spec.name]
    elif spec.kind is datetime and not spec.optional:
        kwargs["default"] = utcnow
    return annotation, mapped_column(*args, **kwargs)


def _parent(table: str) -> Any:
    """A reference to ``table``'s id; its rows go when the parent goes."""
    return mapped_column(ForeignKey(f"{table}.id", ondelete="CASCADE"))


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {
        datetime: UTCDateTime(),
        dict[str, Any]: JSON(),
        list[Any]: JSON(),
        float: Double(),
    }

    def __init_subclass__(cls, record: type | None = None,
                          defaults: dict[str, Any] | None = None, **kw: Any) -> None:
        # The record's fields become columns (with these Python-side insert defaults) before
        # the declarative scan reads the class.
        if record is not None:
            annotations = cls.__dict__.get("__annotations__")
            if annotations is None:
                annotations = {}
                cls.__annotations__ = annotations
            for spec in specs(record):
                if spec.joined or spec.name in cls.__dict__:
                    continue
                annotations[spec.name], column = _column(spec, defaults or {})
                setattr(cls, spec.name, column)
        super().__init_subclass__(**kw)


class Device(Base, record=DeviceRecord):
    """A device fingerprint (``autotuner.Device``); ``key`` is computed by the caller."""

    __tablename__ = "devices"
    __table_args__ = (UniqueConstraint("key"),)


class Problem(Base, record=ProblemRecord):
    """A sharded einsum (``autotuner.Problem``) and the features nearest-shape queries use.

    ``lm, ln, lk, lb`` are the log2 of ``m, n, k, b`` (values below 1 count as 1), stored at
    insert time so the distance can be computed in SQL on every backend.
    """

    __tablename__ = "problems"
    # nearest-shape queries (repository.nearest_winners): the group, a range on lm, and the
    # other log features so the distance is computed from the index alone
    __table_args__ = (
        UniqueConstraint("key"),
        Index("ix_problems_nearest", "pattern", "dtype", "mesh_size", "lm", "ln", "lk", "lb"),
    )

    lm: Mapped[float]
    ln: Mapped[float]
    lk: Mapped[float]
    lb: Mapped[float]


class Measurement(Base, record=MeasurementRecord, defaults={"n": 0}):
    """One timed strategy of one problem on one device (a tuning trial)."""

    __tablename__ = "measurements"
    __table_args__ = (
        Index(None, "device_id", "problem_id"),
        Index(None, "problem_id"),
        CheckConstraint(_in("status", MEASUREMENT_STATUSES), name="status"),
        CheckConstraint(_in("source", MEASUREMENT_SOURCES), name="source"),
    )

    problem_id: Mapped[int] = _parent("problems")
    device_id: Mapped[int] = _parent("devices")


class Winner(Base, record=WinnerRecord):
    """The current best strategy of one problem on one device, derived from measurements."""

    __tablename__ = "winners"
    __table_args__ = (
        UniqueConstraint("device_id", "problem_id"),
        Index(None, "problem_id"),
        Index(None, "method"),
        Index(None, "updated_at"),
    )

    device_id: Mapped[int] = _parent("devices")
    problem_id: Mapped[int] = _parent("problems")


class Failure(Base, record=FailureRecord):
    """A problem that could not be tuned on a device (the latest failure), see FailureRecord."""

    __tablename__ = "failures"
    __table_args__ = (UniqueConstraint("device_id", "problem_id"), Index(None, "problem_id"))

    device_id: Mapped[int] = _parent("devices")
    problem_id: Mapped[int] = _parent("problems")


class TuningJob(Base, record=JobRecord, defaults={"status": "queued", "priority": 0, "attempts": 0}):
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


class Demand(Base, record=DemandRecord, defaults={"count": 1}):
    """Lookup misses per (device, problem): how often a shape was asked for but not tuned."""

    __tablename__ = "demand"
    __table_args__ = (UniqueConstraint("device_key", "problem_key"), Index(None, "last_seen"))


class Token(Base, record=TokenRecord):
    """An API token; only its SHA-256 hex digest is stored."""

    __tablename__ = "tokens"
    __table_args__ = (UniqueConstraint("token_hash"),
                      CheckConstraint(_in("scope", TOKEN_SCOPES), name="scope"))

    token_hash: Mapped[str] = mapped_column(String(64))


class Calibration(Base, record=CalibrationRecord):
    """A device's cost-model parameters from one calibration run (``autotuner calibrate``).

    Append-only: the newest row of a (device, model) is the calibration in use. ``params`` is
    the model's JSON (opaque here), ``raw`` optionally the measurements it was fitted on.
    """

    __tablename__ = "calibrations"
    __table_args__ = (Index(None, "device_id", "model", "created_at"),)

    device_id: Mapped[int] = _parent("devices")


class Generation(Base):
    """The winners' generation counter: one row (id 1), incremented once by every transaction
    that changes a winner or a calibration (:mod:`db._changes`). Taking its row lock last in
    such a transaction orders the generations as the commits, so a reader that has seen
    generation g has seen every change up to g."""

    __tablename__ = "generation"
    __table_args__ = (CheckConstraint("id = 1", name="one_row"),)

    id: Mapped[int] = mapped_column(Integer(), primary_key=True)
    value: Mapped[int] = mapped_column(BigInteger())


class SchemaReaders(Base):
    """Which code may read this schema: one row (id 1), `min_revision` the oldest code's head
    revision that still reads and writes it. An expand-only migration (new nullable columns, new
    tables) leaves it; one that removes or changes what older code uses raises it. Code whose head
    is older than the database's revision serves on where its head is at least this
    (`db.database.check_schema`): a replica one release behind keeps answering during an upgrade."""

    __tablename__ = "schema_readers"
    __table_args__ = (CheckConstraint("id = 1", name="one_row"),)

    id: Mapped[int] = mapped_column(Integer(), primary_key=True)
    min_revision: Mapped[str] = mapped_column(String(32))


class WinnerChange(Base):
    """What changed in one generation: a (device, problem) whose winner was written, or a
    device whose every answer may change (``problem_key`` null, e.g. a new calibration).
    Only the latest rows are kept (:data:`db._changes.KEEP_GENERATIONS` generations)."""

    __tablename__ = "winner_changes"
    __table_args__ = (Index(None, "generation"),)

    id: Mapped[int] = mapped_column(Integer(), primary_key=True)
    generation: Mapped[int] = mapped_column(BigInteger())
    device_key: Mapped[str] = mapped_column(String(KEY_LEN))
    problem_key: Mapped[str | None] = mapped_column(String(KEY_LEN))


class ModelBench(Base, record=ModelBenchRecord):
    """One ``autotuner bench-model`` run (see ModelBenchRecord); append-only."""

    __tablename__ = "model_benches"
    __table_args__ = (Index(None, "device_id", "created_at"), Index(None, "program", "created_at"))

    device_id: Mapped[int] = _parent("devices")


class StepEvidence(Base, record=EvidenceRecord):
    """In-program evidence for one problem's choice (see EvidenceRecord); append-only, the
    newest row of a (device, program, problem) is in use."""

    __tablename__ = "step_evidence"
    __table_args__ = (Index(None, "device_id", "program_key", "problem_key", "created_at"),)

    device_id: Mapped[int] = _parent("devices")

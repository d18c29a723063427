"""Results database of the overlap autotuner: tables (the ORM), sessions, repository, migrations.

Of this project it imports only the light core of ``autotuner`` (``autotuner.settings``, the
one settings object, and ``autotuner.errors``, the exception base). Typical use::

    from db import Database, repository as repo

    database = Database(autotuner.settings.get_settings().db_url)
    database.check_schema()                    # SchemaError: run `autotuner db upgrade`
    with database.session() as s:
        device = repo.upsert_device(s, key=..., platform=..., ...)
        problem = repo.upsert_problem(s, key=..., canonical=..., ...)
        repo.record_measurements(s, device.id, problem.id, items)
        winner = repo.recompute_winner(s, device.id, problem.id)
"""

from db import repository
from db.apply_rule import choose_winner
from db.database import (
    Database,
    check_schema,
    current_revision,
    downgrade,
    head_revision,
    make_engine,
    make_session_factory,
    session_scope,
    upgrade,
)
from db.errors import DuplicateError, LeaseError, NotFoundError, SchemaError, StorageError, URLError
from db.optuna_storage import ensure_optuna_schema, optuna_storage_url
from db.records import (
    CalibrationRecord,
    DemandRecord,
    DeviceRecord,
    FailureRecord,
    JobRecord,
    MeasurementInput,
    MeasurementRecord,
    ModelBenchRecord,
    Neighbor,
    Page,
    ProblemRecord,
    ProblemRow,
    TokenRecord,
    WinnerChoice,
    WinnerRecord,
)

__all__ = [
    "CalibrationRecord",
    "Database",
    "DemandRecord",
    "DeviceRecord",
    "DuplicateError",
    "FailureRecord",
    "JobRecord",
    "LeaseError",
    "MeasurementInput",
    "MeasurementRecord",
    "ModelBenchRecord",
    "Neighbor",
    "NotFoundError",
    "Page",
    "ProblemRecord",
    "ProblemRow",
    "SchemaError",
    "StorageError",
    "URLError",
    "TokenRecord",
    "WinnerChoice",
    "WinnerRecord",
    "check_schema",
    "choose_winner",
    "current_revision",
    "downgrade",
    "ensure_optuna_schema",
    "head_revision",
    "make_engine",
    "make_session_factory",
    "optuna_storage_url",
    "repository",
    "session_scope",
    "upgrade",
]

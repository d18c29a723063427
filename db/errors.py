"""Domain errors of the storage layer.

Nothing outside :mod:`db` needs to know SQLAlchemy's exception types: the session context
manager (:func:`db.database.session_scope`) translates driver errors into these, and the
repository raises them directly. The service maps them to HTTP status codes in one table.
"""

from __future__ import annotations

from autotuner.errors import AutotunerError

__all__ = [
    "DuplicateError",
    "LeaseError",
    "NotFoundError",
    "SchemaError",
    "StorageError",
    "URLError",
]


class StorageError(AutotunerError):
    """A database operation failed (connection lost, locked, bad statement, ...)."""


class DuplicateError(StorageError):
    """A write violated a unique or other integrity constraint."""


class NotFoundError(StorageError):
    """The row an operation needs does not exist."""


class LeaseError(StorageError):
    """A worker acted on a job it does not hold (never claimed, finished, or re-claimed)."""


class SchemaError(StorageError):
    """The database schema is not at the revision this code expects.

    The message names the command that fixes it (``autotuner db upgrade --db URL``).
    """


class URLError(StorageError, ValueError):
    """The database URL does not parse, or names a database this project does not run on."""

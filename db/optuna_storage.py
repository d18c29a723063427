"""Where Optuna keeps its own tables: beside ours, never among them.

Optuna's ``RDBStorage`` runs its own Alembic migrations with their own ``alembic_version``
table, which would clash with ours in the same schema. So:

- SQLite ``.../X.db`` -> a sibling file ``.../X.optuna.db``;
- PostgreSQL: the same database, schema ``optuna`` (``search_path`` set per connection via
  psycopg's ``options=-csearch_path=optuna``); create it first with
  :func:`ensure_optuna_schema`.

Usage (in the tuner)::

    ensure_optuna_schema(db_url)
    storage = optuna.storages.RDBStorage(optuna_storage_url(db_url))

This module does not import Optuna.
"""

from __future__ import annotations

from pathlib import PurePath

from sqlalchemy import make_url, text
from sqlalchemy.exc import SQLAlchemyError

from autotuner.settings import normalize_db_url
from db.database import make_engine, translate_error

__all__ = ["OPTUNA_SCHEMA", "ensure_optuna_schema", "optuna_storage_url"]

OPTUNA_SCHEMA = "optuna"
_LOCK_KEY = 0x6F7074756E61  # "optuna"


def optuna_storage_url(db_url: str) -> str:
    """The Optuna storage URL that belongs to our database URL ``db_url`` (see module docs)."""
    url = make_url(normalize_db_url(db_url))
    backend = url.get_backend_name()
    if backend == "sqlite":
        if url.database in (None, "", ":memory:"):
            return "sqlite:///:memory:"
        path = PurePath(url.database)
        if path.suffix:
            sibling = path.with_name(f"{path.stem}.optuna{path.suffix}")
        else:
            sibling = path.with_name(f"{path.name}.optuna.db")
        return url.set(database=str(sibling)).render_as_string(hide_password=False)
    if backend == "postgresql":
        option = f"-csearch_path={OPTUNA_SCHEMA}"
        existing = url.query.get("options")
        if isinstance(existing, tuple):
            existing = " ".join(existing)
        options = f"{existing} {option}" if existing else option
        return url.update_query_dict({"options": options}).render_as_string(hide_password=False)
    raise ValueError(f"no Optuna storage for database backend {backend!r}")


def ensure_optuna_schema(db_url: str) -> None:
    """Create the ``optuna`` schema on PostgreSQL if missing (no-op on SQLite)."""
    url = make_url(normalize_db_url(db_url))
    if url.get_backend_name() != "postgresql":
        return
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _LOCK_KEY})
            conn.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{OPTUNA_SCHEMA}"'))
    except SQLAlchemyError as exc:
        raise translate_error(exc) from exc
    finally:
        engine.dispose()

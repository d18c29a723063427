"""Alembic environment of the autotuner results database.

Run programmatically by :func:`db.database.upgrade` / :func:`db.database.downgrade`, which pass
an open connection in ``config.attributes["connection"]`` (inside a transaction they commit).
When run from the alembic command line it connects to ``-x url=...``, else to
``config.attributes["url"]``, else to ``AUTOTUNER_DB_URL`` (:class:`autotuner.settings.Settings`).

SQLite gets ``render_as_batch=True`` (ALTER TABLE by copy-and-move), with foreign keys off while
the migrations run (`db.database.migration_connection`). On PostgreSQL an
advisory transaction lock serialises concurrent upgrades (e.g. several replicas starting).
"""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context
from sqlalchemy import text
from sqlalchemy.engine import Connection

from autotuner.settings import get_settings
from db import database
from db.database import make_engine, migration_connection
from db.tables import Base

config = context.config
target_metadata = Base.metadata

# An arbitrary constant: the lock key of "autotuner schema migration".
MIGRATION_LOCK_KEY = 0x6174756E6572  # "atuner"

if config.config_file_name is not None and config.attributes.get("connection") is None:
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _url() -> str:
    x_url = context.get_x_argument(as_dictionary=True).get("url")
    return x_url or config.attributes.get("url") or get_settings().db_url


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )


def _run(connection: Connection) -> None:
    _configure(connection)
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            connection.execute(
                text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY}
            )
            # an ALTER waiting for its table's lock queues every lookup behind it: give up instead
            # (`db.database` retries, then says why)
            connection.execute(text(f"SET LOCAL lock_timeout = {int(database.LOCK_TIMEOUT_S * 1000)}"))
        context.run_migrations()


def run_migrations_offline() -> None:
    context.configure(
        url=_url(),
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        render_as_batch=_url().startswith("sqlite"),
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = make_engine(_url())
    try:
        with migration_connection(engine) as conn:
            _run(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()

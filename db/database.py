"""Engines, sessions, error translation and the schema revision (Alembic).

- :func:`make_engine` builds an engine for SQLite (file, WAL) or PostgreSQL (psycopg 3).
- :func:`session_scope` is the one place database errors are translated: it commits on
  success, rolls back on any error, always closes, and turns ``IntegrityError`` into
  :class:`~db.errors.DuplicateError` and every other SQLAlchemy error into
  :class:`~db.errors.StorageError`.
- :func:`upgrade` / :func:`downgrade` run the package's Alembic migrations programmatically;
  :func:`check_schema` refuses a database that is not at the head revision.

SQLite transactions: a connection from :func:`make_engine` begins every transaction with
``BEGIN IMMEDIATE``, i.e. it takes SQLite's single write lock up front (waiting up to
``busy_timeout``), so a transaction that reads and then writes never fails half-way with
"database is locked". Pure readers may pass ``read_only=True`` to :func:`session_scope`
(plain deferred ``BEGIN``: runs concurrently with a writer, must not write).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy import Engine, create_engine, event, make_url, text
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.engine import URL, Connection
from sqlalchemy.exc import ArgumentError, IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import StaticPool

from autotuner.settings import normalize_db_url, redact_db_url
from db.errors import DuplicateError, SchemaError, StorageError, URLError

__all__ = [
    "MIGRATIONS_DIR",
    "Database",
    "alembic_config",
    "check_schema",
    "current_revision",
    "downgrade",
    "head_revision",
    "make_engine",
    "make_session_factory",
    "read_scope",
    "session_scope",
    "translate_error",
    "upgrade",
]

log = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"

SQLITE_BUSY_TIMEOUT_MS = 30_000
PG_CONNECT_TIMEOUT_S = 10

# Execution option read by the SQLite "begin" hook: which BEGIN to emit.
_SQLITE_BEGIN = "autotuner_sqlite_begin"
_SQLITE_BEGIN_MODES = ("DEFERRED", "IMMEDIATE", "EXCLUSIVE")


def _is_memory_sqlite(url: URL) -> bool:
    return url.get_backend_name() == "sqlite" and url.database in (None, "", ":memory:")


def make_engine(url: str | os.PathLike[str] | URL, **kwargs: Any) -> Engine:
    """An engine for ``url`` (normalised as in :func:`autotuner.settings.normalize_db_url`).

    SQLite: on every new connection ``journal_mode=WAL``, ``busy_timeout=30000`` and
    ``foreign_keys=ON``; transactions begin with ``BEGIN IMMEDIATE`` (see module docs).
    An in-memory URL uses a single shared connection. PostgreSQL: psycopg 3,
    ``pool_pre_ping``, a 10 s connect timeout unless the URL sets one.
    ``kwargs`` go to :func:`sqlalchemy.create_engine`.
    """
    text = url.render_as_string(hide_password=False) if isinstance(url, URL) else url
    try:
        sa_url = make_url(normalize_db_url(text))
    except (ArgumentError, ValueError) as e:   # the CLI and the service say it in one line
        raise URLError(f"database URL {redact_db_url(os.fspath(text))!r} does not parse: {e}") from None
    backend = sa_url.get_backend_name()
    if backend == "sqlite":
        if _is_memory_sqlite(sa_url):
            kwargs.setdefault("poolclass", StaticPool)
            kwargs.setdefault("connect_args", {"check_same_thread": False})
        engine = create_engine(sa_url, **kwargs)
        _install_sqlite_hooks(engine, memory=_is_memory_sqlite(sa_url))
        return engine
    if backend == "postgresql":
        connect_args = dict(kwargs.pop("connect_args", {}))
        if "connect_timeout" not in sa_url.query:
            connect_args.setdefault("connect_timeout", PG_CONNECT_TIMEOUT_S)
        kwargs.setdefault("pool_pre_ping", True)
        return create_engine(sa_url, connect_args=connect_args, **kwargs)
    raise URLError(
        f"unsupported database URL {redact_db_url(str(sa_url))!r}: "
        "use sqlite:///FILE or postgresql+psycopg://USER:PASSWORD@HOST/DB"
    )


def _install_sqlite_hooks(engine: Engine, *, memory: bool) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, connection_record: Any) -> None:
        # SQLAlchemy emits BEGIN itself (below); the driver must not.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            # busy_timeout first: switching a new file to WAL needs a lock another
            # connection may hold.
            cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
            if not memory:
                cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA foreign_keys=ON")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        mode = conn.get_execution_options().get(_SQLITE_BEGIN, "IMMEDIATE")
        if mode not in _SQLITE_BEGIN_MODES:
            raise ValueError(f"{_SQLITE_BEGIN} must be one of {_SQLITE_BEGIN_MODES}, not {mode!r}")
        conn.exec_driver_sql(f"BEGIN {mode}")


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    """A session factory bound to ``engine`` (objects are not expired on commit)."""
    return sessionmaker(bind=engine, expire_on_commit=False)


def translate_error(exc: SQLAlchemyError) -> StorageError:
    """The domain error for a SQLAlchemy error (the statement's parameters are not shown)."""
    orig = getattr(exc, "orig", None)
    detail = str(orig if orig is not None else exc).strip().splitlines()
    message = detail[0] if detail else type(exc).__name__
    if isinstance(exc, IntegrityError):
        return DuplicateError(f"integrity constraint violated: {message}")
    return StorageError(f"database error ({type(exc).__name__}): {message}")


@contextmanager
def session_scope(
    bind: sessionmaker[Session] | Engine, *, read_only: bool = False
) -> Iterator[Session]:
    """A transactional session: commit on success, roll back on error, always close.

    ``bind`` is a session factory or an engine. SQLAlchemy errors raised inside the block or
    at commit come out as :class:`DuplicateError` (integrity violations) or
    :class:`StorageError` (anything else), chained to the original. Other exceptions
    (including the repository's domain errors) propagate unchanged after the rollback.
    ``read_only=True`` only changes how SQLite begins (deferred; see module docs).
    """
    if isinstance(bind, Engine):
        session = Session(bind=bind, expire_on_commit=False)
    else:
        session = bind()
    try:
        if read_only and session.get_bind().dialect.name == "sqlite":
            session.connection(execution_options={_SQLITE_BEGIN: "DEFERRED"})
        yield session
        session.commit()
    except SQLAlchemyError as exc:
        _rollback_quietly(session)
        raise translate_error(exc) from exc
    except BaseException:
        _rollback_quietly(session)
        raise
    finally:
        session.close()


@contextmanager
def read_scope(engine: Engine) -> Iterator[Connection]:
    """A connection in a read transaction (SQLite: a deferred ``BEGIN``, beside a writer), for
    the lookup path's plain statements: no ORM session to build and close (about a third of a
    single lookup's database time). Errors translated as in :func:`session_scope`; the body
    must not write."""
    try:
        with engine.connect() as conn:
            if engine.dialect.name == "sqlite":
                conn.execution_options(**{_SQLITE_BEGIN: "DEFERRED"})
            with conn.begin():
                yield conn
    except SQLAlchemyError as exc:
        raise translate_error(exc) from exc


def _rollback_quietly(session: Session) -> None:
    try:
        session.rollback()
    except SQLAlchemyError:  # the connection may be gone; closing discards it
        log.debug("rollback failed", exc_info=True)


# --------------------------------------------------------------------------- Alembic


def alembic_config(url: str | None = None) -> Config:
    """An Alembic ``Config`` for this package's migrations, built in code (no ini file).

    ``url`` (optional) is the database ``env.py`` connects to when no connection is passed
    in ``config.attributes["connection"]``; without either it uses ``AUTOTUNER_DB_URL``.
    """
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("path_separator", "os")
    if url is not None:
        cfg.attributes["url"] = normalize_db_url(url)
    return cfg


def head_revision() -> str:
    """The revision this code expects the database to be at."""
    heads = ScriptDirectory.from_config(alembic_config()).get_heads()
    if len(heads) != 1:  # pragma: no cover - a packaging error, caught by the tests
        raise SchemaError(f"migrations have {len(heads)} heads {heads}; expected one")
    return heads[0]


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at, or ``None`` if it was never migrated."""
    try:
        with engine.connect() as conn:
            heads = MigrationContext.configure(conn).get_current_heads()
    except SQLAlchemyError as exc:
        raise translate_error(exc) from exc
    if len(heads) > 1:
        raise SchemaError(f"database has several revisions {heads}; expected one")
    return heads[0] if heads else None


def check_schema(engine: Engine) -> None:
    """Raise :class:`SchemaError` unless this code reads the database's schema: it is at the head
    revision, or at a later one whose ``schema_readers`` row names a revision this code knows (an
    expand-only upgrade: a replica one release behind serves on while the new code rolls out).

    The message names the fix: ``autotuner db upgrade --db URL`` (password hidden).
    """
    head = head_revision()
    current = current_revision(engine)
    if current == head:
        return
    shown = engine.url.render_as_string(hide_password=True)
    fix = f"run: autotuner db upgrade --db {shown}"
    if current is None:
        raise SchemaError(
            f"database {shown} has no autotuner schema (empty, or never migrated); {fix}"
        )
    script = ScriptDirectory.from_config(alembic_config())
    if not _known(script, current):
        reader = min_reader(engine)
        if reader is not None and _known(script, reader):
            return   # newer, but expand-only since a revision this code has: it reads and writes it
        needs = f" (it needs code at {reader!r} or later)" if reader else ""
        raise SchemaError(
            f"database {shown} is at revision {current!r}, which this version of autotuner "
            f"does not know (head is {head!r}): the database is newer{needs}; upgrade autotuner"
        )
    raise SchemaError(
        f"database {shown} is at revision {current!r}, this code needs {head!r}; {fix}"
    )


def min_reader(engine: Engine) -> str | None:
    """The oldest code revision that reads this database (`db.tables.SchemaReaders`), None where
    the table is absent (a database before 0010) or empty."""
    with engine.connect() as conn:
        if not sa_inspect(conn).has_table("schema_readers"):
            return None
        return conn.execute(text("SELECT min_revision FROM schema_readers WHERE id = 1")).scalar()


def _known(script: ScriptDirectory, revision: str) -> bool:
    try:
        return script.get_revision(revision) is not None
    except CommandError:
        return False


@contextmanager
def migration_connection(engine: Engine) -> Iterator[Connection]:
    """A connection in one transaction for migrations. On SQLite with foreign keys off while they
    run: batch mode recreates a table by copy, drop and rename, and with foreign keys on, dropping
    the old parent table cascades to its children's rows (a downgrade once deleted every
    measurement and winner). The keys are checked before the commit (SchemaError if one dangles)
    and switched on again after."""
    with engine.connect() as conn:
        raw = conn.connection.dbapi_connection if engine.dialect.name == "sqlite" else None
        if raw is not None:
            raw.execute("PRAGMA foreign_keys=OFF")   # outside any transaction, where SQLite honours it
        try:
            with conn.begin():
                yield conn
                if raw is not None and (bad := conn.exec_driver_sql("PRAGMA foreign_key_check").fetchall()):
                    raise SchemaError(f"the migration would leave {len(bad)} row(s) whose parent is gone "
                                      f"(first: table {bad[0][0]}, row {bad[0][1]}); nothing was changed")
        finally:
            if raw is not None:
                raw.execute("PRAGMA foreign_keys=ON")


# PostgreSQL: how long a migration waits for a table's lock before it gives up (every lookup would
# queue behind its ALTER meanwhile), and how often it tries
LOCK_TIMEOUT_S = 5.0
MIGRATION_TRIES = 3


def _lock_timeout(exc: BaseException) -> bool:
    return getattr(getattr(exc, "orig", None), "sqlstate", None) == "55P03"   # lock_not_available


def _run_alembic(url_or_engine: str | Engine, fn: Any, revision: str) -> None:
    own = not isinstance(url_or_engine, Engine)
    engine = make_engine(url_or_engine) if own else url_or_engine
    assert isinstance(engine, Engine)
    try:
        for attempt in range(1, MIGRATION_TRIES + 1):
            try:
                with migration_connection(engine) as conn:
                    cfg = alembic_config()
                    cfg.attributes["connection"] = conn
                    fn(cfg, revision)
                return
            except SQLAlchemyError as exc:
                if not _lock_timeout(exc):
                    raise translate_error(exc) from exc
                if attempt == MIGRATION_TRIES:
                    raise SchemaError(
                        f"the migration gave up waiting {LOCK_TIMEOUT_S:g} s for a table's lock, {attempt} times: "
                        "another connection holds it (a long query or an open transaction); nothing was "
                        "changed; run it again when that ends") from exc
                log.warning("migration: a table's lock was not free within %g s (try %d of %d); trying again",
                            LOCK_TIMEOUT_S, attempt, MIGRATION_TRIES)
                time.sleep(attempt)
    finally:
        if own:
            engine.dispose()


def upgrade(url: str | Engine, revision: str = "head") -> None:
    """Migrate the database at ``url`` (or behind an engine) up to ``revision``."""
    _run_alembic(url, command.upgrade, revision)


def downgrade(url: str | Engine, revision: str) -> None:
    """Migrate the database down to ``revision`` (``"base"``: drop every table of ours)."""
    _run_alembic(url, command.downgrade, revision)


# --------------------------------------------------------------------------- Database


class Database:
    """An engine and its session factory for one URL.

    >>> database = Database("sqlite:///autotuner.db")   # doctest: +SKIP
    >>> database.check_schema()                          # doctest: +SKIP
    >>> with database.session() as s:                    # doctest: +SKIP
    ...     repository.get_winner(s, device_key, problem_key)
    """

    def __init__(self, url: str, **engine_kwargs: Any) -> None:
        self.url = normalize_db_url(url)
        self.engine = make_engine(self.url, **engine_kwargs)
        self.sessions = make_session_factory(self.engine)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def session(self, *, read_only: bool = False) -> AbstractContextManager[Session]:
        """:func:`session_scope` on this database's session factory."""
        return session_scope(self.sessions, read_only=read_only)

    def reader(self) -> AbstractContextManager[Connection]:
        """:func:`read_scope` on this database's engine."""
        return read_scope(self.engine)

    def check_schema(self) -> None:
        check_schema(self.engine)

    def upgrade(self, revision: str = "head") -> None:
        upgrade(self.engine, revision)

    def dispose(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Database:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.dispose()

    def __repr__(self) -> str:
        return f"Database({redact_db_url(self.url)!r})"

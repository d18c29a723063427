"""Fixtures for the db tests: a fresh database per test, on SQLite and on PostgreSQL.

``backend`` is parametrised over ``["sqlite", "postgres"]``. PostgreSQL tests (marked
``postgres``) connect to ``AUTOTUNER_TEST_PG_URL`` (a database the user may create databases
from, e.g. ``postgresql+psycopg://postgres:postgres@127.0.0.1:5432/autotuner_test``; see
scripts/ci_services.sh). Without it they skip, unless ``AUTOTUNER_REQUIRE_POSTGRES=1``:
then they fail. Every PostgreSQL test gets its own database (``CREATE DATABASE ...
TEMPLATE`` of one migrated once per session), dropped afterwards; every SQLite test a copy
of a migrated file under ``tmp_path``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from db import Database

BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.fixture
def empty_db_url(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """URL of a fresh, empty database (no tables)."""
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'empty.db'}"
        return
    pg = request.getfixturevalue("pg_server")  # tests/conftest.py
    name = pg.create()
    yield pg.url_for(name)
    pg.drop(name)


@pytest.fixture
def database(db_url: str) -> Iterator[Database]:
    """A :class:`db.Database` on a fresh migrated database."""
    database = Database(db_url)
    yield database
    database.dispose()

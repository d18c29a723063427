"""Fixtures for the service tests: a fresh database per test (SQLite; PostgreSQL where marked),
an app factory and the request bodies the tests share.

PostgreSQL tests (marked ``postgres``) use ``AUTOTUNER_TEST_PG_URL``; without it they skip,
unless ``AUTOTUNER_REQUIRE_POSTGRES=1``: then they fail (the pattern of tests/db/conftest.py).
"""

from __future__ import annotations

import itertools
import os
import shutil
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool
from starlette.exceptions import StarletteDeprecationWarning

from db import Database, Settings, normalize_db_url, upgrade
from service import create_app
from service.testing import DEVICE, WRITE_HEADERS, WRITE_TOKEN, measurements

with warnings.catch_warnings():
    # Starlette 1.x prefers the httpx2 package for its TestClient and warns once about httpx.
    warnings.simplefilter("ignore", StarletteDeprecationWarning)
    from fastapi.testclient import TestClient

PG_URL_ENV = "AUTOTUNER_TEST_PG_URL"
REQUIRE_PG_ENV = "AUTOTUNER_REQUIRE_POSTGRES"
BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


def _require_postgres() -> bool:
    return os.environ.get(REQUIRE_PG_ENV, "").strip().lower() in ("1", "true", "yes")


def _unavailable(reason: str) -> None:
    if _require_postgres():
        pytest.fail(f"PostgreSQL required ({REQUIRE_PG_ENV}=1) but {reason}", pytrace=False)
    pytest.skip(f"PostgreSQL not available: {reason} (set {PG_URL_ENV})")


class PgServer:
    """Creates and drops uniquely named databases on the test server."""

    def __init__(self, url: str) -> None:
        self.url = make_url(normalize_db_url(url))
        self.admin: Engine = create_engine(self.url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
        self._prefix = f"autotuner_s{os.getpid()}_{uuid.uuid4().hex[:6]}"
        self._counter = itertools.count()
        self._template: str | None = None
        self._created: set[str] = set()

    def url_for(self, name: str) -> str:
        return self.url.set(database=name).render_as_string(hide_password=False)

    def create(self, *, template: str | None = None) -> str:
        name = f"{self._prefix}_{next(self._counter)}"
        with self.admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}" TEMPLATE "{template or "template1"}"'))
        self._created.add(name)
        return name

    def drop(self, name: str) -> None:
        with self.admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        self._created.discard(name)

    def migrated_template(self) -> str:
        if self._template is None:
            name = self.create()
            upgrade(self.url_for(name))
            self._template = name
        return self._template

    def close(self) -> None:
        for name in sorted(self._created):
            self.drop(name)
        self.admin.dispose()


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    url = os.environ.get(PG_URL_ENV, "").strip()
    if not url:
        _unavailable(f"{PG_URL_ENV} is not set")
    server = PgServer(url)
    try:
        with server.admin.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:  # any connection failure means "unavailable"
        server.admin.dispose()
        _unavailable(f"cannot connect to {server.url.render_as_string()}: {exc}")
    yield server
    server.close()


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("service-template") / "autotuner.db"
    upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def db_url(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """URL of a fresh database at the head revision."""
    if backend == "sqlite":
        template = request.getfixturevalue("sqlite_template")
        path = tmp_path / "autotuner.db"
        shutil.copyfile(template, path)
        yield f"sqlite:///{path}"
        return
    pg: PgServer = request.getfixturevalue("pg_server")
    name = pg.create(template=pg.migrated_template())
    yield pg.url_for(name)
    pg.drop(name)


@pytest.fixture
def sqlite_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh SQLite database (for tests that need no PostgreSQL twin)."""
    path = tmp_path / "autotuner.db"
    shutil.copyfile(request.getfixturevalue("sqlite_template"), path)
    return f"sqlite:///{path}"


@pytest.fixture
def database(db_url: str) -> Iterator[Database]:
    database = Database(db_url)
    yield database
    database.dispose()


ClientFactory = Callable[..., TestClient]


@pytest.fixture
def make_client(db_url: str) -> Iterator[ClientFactory]:
    """``make_client(**settings)`` -> a started TestClient on this test's database (write token
    ``WRITE_TOKEN``; reads open unless ``read_tokens`` is given)."""
    opened: list[TestClient] = []

    def make(*, model: Any = None, **overrides: Any) -> TestClient:
        values: dict[str, Any] = {"db_url": db_url, "write_tokens": [WRITE_TOKEN], **overrides}
        kwargs = {"model": model} if model is not None else {}
        client = TestClient(create_app(Settings(**values), **kwargs))
        client.__enter__()
        opened.append(client)
        return client

    yield make
    for c in opened:
        c.__exit__(None, None, None)


@pytest.fixture(scope="session")
def testclient_cls() -> type[TestClient]:
    return TestClient


@pytest.fixture
def client(make_client: ClientFactory) -> TestClient:
    return make_client()


@pytest.fixture
def post_results() -> Callable[..., Any]:
    """``post_results(client, problem_json, ratio=1.25, device=DEVICE, strategy=RING)`` -> body."""

    def post(c: TestClient, p: dict[str, Any], ratio: float = 1.25,
             device: dict[str, Any] | None = None, strategy: dict[str, Any] | None = None) -> Any:
        r = c.post("/v1/results", headers=WRITE_HEADERS, json={"device": device or DEVICE, "problem": p,
                                                       "measurements": measurements(ratio, strategy)})
        assert r.status_code == 201, r.text
        return r.json()

    return post

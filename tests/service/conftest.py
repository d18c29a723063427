"""Fixtures for the service tests: a fresh database per test (SQLite; PostgreSQL where marked),
an app factory and the request bodies the tests share.

PostgreSQL tests (marked ``postgres``) use the ``pg_server`` fixture of tests/conftest.py
(``AUTOTUNER_TEST_PG_URL``; they skip without it unless ``AUTOTUNER_REQUIRE_POSTGRES=1``).
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.exceptions import StarletteDeprecationWarning

from autotuner.settings import Settings
from db import Database
from service import create_app
from service.testing import DEVICE, WRITE_HEADERS, WRITE_TOKEN, measurements

with warnings.catch_warnings():
    # Starlette 1.x prefers the httpx2 package for its TestClient and warns once about httpx.
    warnings.simplefilter("ignore", StarletteDeprecationWarning)
    from fastapi.testclient import TestClient

BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


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

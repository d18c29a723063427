"""Test-wide setup: 8 in-process CPU devices (set before JAX is imported anywhere)."""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import itertools  # noqa: E402
import shutil  # noqa: E402
import uuid  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
from sqlalchemy import Engine, create_engine, text  # noqa: E402
from sqlalchemy.engine import make_url  # noqa: E402
from sqlalchemy.pool import NullPool  # noqa: E402

from autotuner.settings import normalize_db_url  # noqa: E402
from db import upgrade  # noqa: E402

REQUIRE_TPU_ENV = "AUTOTUNER_REQUIRE_TPU"

# Modules collected last that hold minute-long subprocess tests (the README's commands, the bare
# package's venv): run first, so that none of them starts when the other workers are nearly done
# and the run waits on it alone (pytest-xdist hands tests out in collection order).
FIRST = ("tests/test_readme.py", "tests/test_package.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    first = [i for i in items if i.nodeid.startswith(FIRST)]
    if first:
        items[:] = first + [i for i in items if not i.nodeid.startswith(FIRST)]


@pytest.fixture(scope="session")
def tpu_devices() -> Callable[[str], list[Any]]:
    """libtpu's compile-only devices of a TPU topology (`aot:tpu:NAME`), for the `tpu` tests; they
    skip without libtpu, and fail instead under AUTOTUNER_REQUIRE_TPU=1 (`make test` installs it)."""
    from autotuner.measure.aot import AotError, AotSpec, topology_devices

    def get(name: str) -> list[Any]:
        try:
            return topology_devices(AotSpec.parse(f"aot:tpu:{name}"))
        except AotError as e:
            if os.environ.get(REQUIRE_TPU_ENV, "").strip().lower() in ("1", "true", "yes"):
                pytest.fail(f"the XLA:TPU compiler is required ({REQUIRE_TPU_ENV}=1): {e}", pytrace=False)
            pytest.skip(f"the XLA:TPU compiler is not available: {e}")
    return get


PG_URL_ENV = "AUTOTUNER_TEST_PG_URL"
REQUIRE_PG_ENV = "AUTOTUNER_REQUIRE_POSTGRES"

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
        self.admin: Engine = create_engine(
            self.url, isolation_level="AUTOCOMMIT", poolclass=NullPool
        )
        self._prefix = f"autotuner_t{os.getpid()}_{uuid.uuid4().hex[:6]}"
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
        """A database at the head revision, created once, used as a template."""
        if self._template is None:
            name = self.create()
            upgrade(self.url_for(name))  # disposes its engine: no session left on the template
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




@pytest.fixture
def pg_url(pg_server: PgServer) -> Iterator[str]:
    """URL of a fresh, empty PostgreSQL database (no schema), dropped afterwards."""
    name = pg_server.create()
    yield pg_server.url_for(name)
    pg_server.drop(name)


BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite file at the head revision, copied for every test."""
    path = tmp_path_factory.mktemp("template") / "autotuner.db"
    upgrade(f"sqlite:///{path}")
    for suffix in ("-wal", "-shm"):  # the last connection closed: the WAL is checkpointed
        assert not Path(f"{path}{suffix}").exists() or Path(f"{path}{suffix}").stat().st_size == 0
    return path


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def db_url(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """URL of a fresh database migrated to head."""
    if backend == "sqlite":
        template = request.getfixturevalue("sqlite_template")
        path = tmp_path / "autotuner.db"
        shutil.copyfile(template, path)
        yield f"sqlite:///{path}"
        return
    pg = request.getfixturevalue("pg_server")  # tests/conftest.py
    name = pg.create(template=pg.migrated_template())
    yield pg.url_for(name)
    pg.drop(name)

"""Test-wide setup: 8 in-process CPU devices (set before JAX is imported anywhere)."""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import itertools  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
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



# Each xdist group's seconds in a recorded run (`make test --record-group-seconds`, or
# `scripts/test.sh --record-group-seconds`): `make test` starts the longest groups first, so that
# no long module is left to run alone at the end. A group not recorded counts as the median.
GROUP_SECONDS = Path(__file__).with_name("group_seconds.json")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--record-group-seconds", action="store_true",
                     help=f"write each test group's seconds to {GROUP_SECONDS.name} (the order make test runs them in)")


def _group(nodeid: str, keywords: Any) -> str:
    """A test's xdist group: its module, or `lab` for the multi-process lab tests."""
    return "lab" if "lab" in keywords else nodeid.split("::")[0].split("@")[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`make test` runs two workers, `--dist loadgroup`): each module's tests
    run in one worker, so a module's fixtures (one model build per module) are built once; the
    `lab` tests, each a mesh of several JAX processes, all in one worker, one at a time, so that
    two labs never share the cores with each other. The groups are ordered longest first
    (`GROUP_SECONDS`), each group's tests in their own order."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    groups = {id(item): _group(item.nodeid, item.keywords) for item in items}
    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[id(item)]))
    try:
        seconds = {str(k): float(v) for k, v in json.loads(GROUP_SECONDS.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        seconds = {}
    default = statistics.median(seconds.values()) if seconds else 0.0
    items.sort(key=lambda item: -seconds.get(groups[id(item)], default))   # stable: in-group order kept


_recorded: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Each phase's seconds, summed per group (under xdist the controller sees every worker's)."""
    group = _group(report.nodeid, report.keywords)
    _recorded[group] = _recorded.get(group, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if session.config.getoption("record_group_seconds") and not hasattr(session.config, "workerinput") and _recorded:
        try:
            kept = json.loads(GROUP_SECONDS.read_text())
        except (OSError, ValueError):
            kept = {}
        kept.update((k, round(v, 1)) for k, v in _recorded.items())   # a partial run keeps the others
        GROUP_SECONDS.write_text(json.dumps(dict(sorted(kept.items())), indent=1) + "\n")

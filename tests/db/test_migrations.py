"""Migrations (upgrade an empty database, downgrade to base, models == migrations), the
schema check, and Optuna's storage kept apart from ours; on SQLite and PostgreSQL."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.pool import NullPool

from db import (
    Database,
    SchemaError,
    check_schema,
    current_revision,
    downgrade,
    ensure_optuna_schema,
    head_revision,
    make_engine,
    optuna_storage_url,
    upgrade,
)
from db import repository as repo
from db.database import MIGRATIONS_DIR
from db.tables import Base

OUR_TABLES = {"devices", "problems", "measurements", "winners", "tuning_jobs", "demand", "tokens",
              "calibrations", "failures", "generation", "winner_changes", "model_benches", "step_evidence",
              "schema_readers"}
TABLES_0001 = OUR_TABLES - {"calibrations", "failures", "generation", "winner_changes", "model_benches", "step_evidence",
                            "schema_readers"}
REPO_ROOT = Path(__file__).resolve().parents[2]


def table_names(url: str, schema: str | None = None) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names(schema=schema))
    finally:
        engine.dispose()


def test_one_head_shipped_with_the_package() -> None:
    assert head_revision() == "0010"
    assert (MIGRATIONS_DIR / "env.py").is_file()
    assert (MIGRATIONS_DIR / "script.py.mako").is_file()
    assert (MIGRATIONS_DIR.parent / "alembic.ini").is_file()


def test_upgrade_empty_to_head_and_downgrade_to_base(empty_db_url: str) -> None:
    engine = make_engine(empty_db_url)
    try:
        assert current_revision(engine) is None
        with pytest.raises(SchemaError, match="autotuner db upgrade --db "):
            check_schema(engine)

        upgrade(empty_db_url)
        assert current_revision(engine) == head_revision()
        check_schema(engine)
        assert table_names(empty_db_url) == OUR_TABLES | {"alembic_version"}
        upgrade(empty_db_url)  # already at head: a no-op

        downgrade(empty_db_url, "base")
        assert current_revision(engine) is None
        assert table_names(empty_db_url) <= {"alembic_version"}
        with pytest.raises(SchemaError, match="autotuner db upgrade --db "):
            check_schema(engine)

        upgrade(engine)  # an engine works as well as a URL
        check_schema(engine)
        with Database(empty_db_url) as database, database.session() as s:
            assert repo.upsert_device(
                s,
                key="k",
                platform="cpu",
                device_kind="cpu",
                num_devices=1,
                num_processes=1,
                topology=None,
                jax_version="1",
                jaxlib_version="1",
            ).id
    finally:
        engine.dispose()


DEVICE = {"key": "dev-1", "platform": "cpu", "device_kind": "cpu", "num_devices": 2, "num_processes": 2,
          "topology": "lab-shared-2gbit", "jax_version": "0.10.2", "jaxlib_version": "0.10.2"}


def test_upgrade_a_kept_0001_database_with_data(empty_db_url: str) -> None:
    """A database left at 0001 with results in it: 0002 adds calibrations and keeps every row;
    downgrading to 0001 refuses while a calibration would go, then drops only that table."""
    engine = make_engine(empty_db_url)
    try:
        upgrade(empty_db_url, "0001")
        assert current_revision(engine) == "0001"
        assert table_names(empty_db_url) == TABLES_0001 | {"alembic_version"}
        with pytest.raises(SchemaError):
            check_schema(engine)  # behind the head: the service refuses it until upgraded
        # rows written with 0001's tables only (plain SQL: today's models include calibrations)
        with engine.begin() as conn:
            conn.execute(text(
                "INSERT INTO devices (key, platform, device_kind, num_devices, num_processes, topology, "
                "jax_version, jaxlib_version, created_at) VALUES (:key, :platform, :device_kind, "
                ":num_devices, :num_processes, :topology, :jax_version, :jaxlib_version, "
                "CURRENT_TIMESTAMP)"), DEVICE)
            conn.execute(text(
                "INSERT INTO tokens (name, token_hash, scope, created_at) VALUES ('t', 'h', 'read', "
                "CURRENT_TIMESTAMP)"))

        upgrade(empty_db_url)
        assert current_revision(engine) == head_revision()
        check_schema(engine)
        with Database(empty_db_url) as database, database.session() as s:
            dev = repo.get_device_by_key(s, "dev-1")
            assert dev is not None and dev.topology == "lab-shared-2gbit"
            assert [t.name for t in repo.list_tokens(s)] == ["t"]
            rec = repo.add_calibration(s, dev.id, model="costmodel-v1", params={"alpha": 1e-4})
            assert rec.device_key == "dev-1"
        with Database(empty_db_url) as database, database.session(read_only=True) as s:
            got = repo.get_calibration(s, "dev-1", model="costmodel-v1")
            assert got is not None and got.params == {"alpha": 1e-4}

        # the calibration is a result: the downgrade that would drop it refuses, changing nothing
        with pytest.raises(SchemaError, match=r"below 0002 would drop calibrations \(1 row\)"):
            downgrade(empty_db_url, "0001")
        assert current_revision(engine) == head_revision()
        with engine.begin() as conn:
            conn.execute(text("DELETE FROM calibrations"))
        downgrade(empty_db_url, "0001")
        assert current_revision(engine) == "0001"
        assert table_names(empty_db_url) == TABLES_0001 | {"alembic_version"}
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM devices")).scalar_one() == 1
        upgrade(empty_db_url)  # and up again
        check_schema(engine)
    finally:
        engine.dispose()


def test_migrations_match_the_models(db_url: str) -> None:
    """What the migrations create is what the models declare (no autogenerate diff)."""
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            diff = compare_metadata(context, Base.metadata)
    finally:
        engine.dispose()
    assert diff == []


def test_check_schema_rejects_an_unknown_revision_unless_it_declares_this_code_a_reader(db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("UPDATE alembic_version SET version_num = 'ffff9999'"))
        check_schema(engine)   # newer, but expand-only since 0009 (schema_readers): this code reads it
        with engine.begin() as conn:
            conn.execute(text("UPDATE schema_readers SET min_revision = 'ffff9998'"))
        with pytest.raises(SchemaError, match="newer") as excinfo:
            check_schema(engine)
        assert "ffff9999" in str(excinfo.value) and "needs code at 'ffff9998'" in str(excinfo.value)
        with engine.begin() as conn:
            conn.execute(text("DELETE FROM schema_readers"))
        with pytest.raises(SchemaError, match="newer"):
            check_schema(engine)
    finally:
        engine.dispose()


def test_schema_error_hides_the_password(empty_db_url: str) -> None:
    engine = make_engine(empty_db_url)
    try:
        with pytest.raises(SchemaError) as excinfo:
            check_schema(engine)
    finally:
        engine.dispose()
    password = engine.url.password
    if password:
        assert f":{password}@" not in str(excinfo.value) and ":***@" in str(excinfo.value)


@pytest.mark.postgres
def test_a_migration_waiting_for_a_lock_gives_up_and_says_why(pg_server, monkeypatch: pytest.MonkeyPatch) -> None:
    """An ALTER waiting for a table that a long transaction reads would queue every lookup behind
    it: the migration waits at most LOCK_TIMEOUT_S per try, tries MIGRATION_TRIES times, then
    fails saying why with nothing changed; once the reader is gone it runs."""
    import time

    from db import database as dbmod

    monkeypatch.setattr(dbmod, "LOCK_TIMEOUT_S", 0.3)
    monkeypatch.setattr(dbmod, "MIGRATION_TRIES", 2)
    url = pg_server.url_for(pg_server.create())
    upgrade(url, "0008")
    reader = create_engine(url, poolclass=NullPool)
    try:
        with reader.connect() as conn:
            conn.execute(text("BEGIN"))
            conn.execute(text("LOCK TABLE measurements IN ACCESS SHARE MODE"))   # a long read
            t0 = time.monotonic()
            with pytest.raises(SchemaError, match=r"gave up waiting 0.3 s for a table's lock, 2 times"):
                upgrade(url, "head")   # 0009 alters measurements
            assert time.monotonic() - t0 < 10
            assert current_revision(reader) == "0008"   # nothing changed
            conn.execute(text("ROLLBACK"))
        upgrade(url, "head")
        assert current_revision(reader) == head_revision()
    finally:
        reader.dispose()


def test_concurrent_upgrades_do_not_collide(empty_db_url: str) -> None:
    """Several processes (e.g. replicas starting) upgrading one empty database at once."""
    code = "import sys; from db import upgrade; upgrade(sys.argv[1])"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, empty_db_url],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err for _, err in results]
    engine = make_engine(empty_db_url)
    try:
        check_schema(engine)
    finally:
        engine.dispose()


def test_alembic_command_line_with_the_ini(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    ini = REPO_ROOT / "db" / "alembic.ini"
    for args in (["upgrade", "head"], ["current"]):
        done = subprocess.run(
            [sys.executable, "-m", "alembic", "-c", str(ini), "-x", f"url={url}", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
    assert f"{head_revision()} (head)" in done.stdout
    engine = make_engine(url)
    try:
        check_schema(engine)
    finally:
        engine.dispose()


# --------------------------------------------------------------------------- Optuna


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        ("sqlite:////data/autotuner.db", "sqlite:////data/autotuner.optuna.db"),
        ("sqlite:////data/results", "sqlite:////data/results.optuna.db"),
        ("sqlite:///rel/x.sqlite", "sqlite:///rel/x.optuna.sqlite"),
        (":memory:", "sqlite:///:memory:"),
        (
            "postgres://u:p@h:5432/db",
            "postgresql+psycopg://u:p@h:5432/db?options=-csearch_path%3Doptuna",
        ),
        (
            "postgresql://u:p@h/db?options=-cstatement_timeout%3D5000",
            "postgresql+psycopg://u:p@h/db?options=-cstatement_timeout%3D5000+-csearch_path%3Doptuna",
        ),
    ],
)
def test_optuna_storage_url(ours: str, theirs: str) -> None:
    assert optuna_storage_url(ours) == theirs


def test_optuna_tables_live_apart_from_ours(db_url: str, backend: str) -> None:
    optuna = pytest.importorskip("optuna")
    ensure_optuna_schema(db_url)
    ensure_optuna_schema(db_url)  # idempotent
    before = table_names(db_url)

    storage = optuna.storages.RDBStorage(optuna_storage_url(db_url))
    try:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(study_name="s", storage=storage)
        study.optimize(lambda t: t.suggest_float("x", 0, 1) ** 2, n_trials=3)
        assert len(study.trials) == 3
    finally:
        storage.remove_session()
        storage.engine.dispose()

    assert table_names(db_url) == before  # our schema/file untouched
    engine = make_engine(db_url)
    try:
        check_schema(engine)  # our alembic_version still says our head
    finally:
        engine.dispose()

    if backend == "sqlite":
        theirs_url = optuna_storage_url(db_url)
        assert Path(theirs_url.removeprefix("sqlite:///")).is_file()
        theirs = table_names(theirs_url)
    else:
        theirs = table_names(db_url, schema="optuna")
        assert "alembic_version" in theirs
    assert {"studies", "trials", "alembic_version"} <= theirs
    assert not theirs & OUR_TABLES

    # Optuna's alembic_version is not ours: downgrading ours leaves theirs alone.
    downgrade(db_url, "base")
    if backend == "postgres":
        assert {"studies", "trials"} <= table_names(db_url, schema="optuna")
        engine = create_engine(db_url, poolclass=NullPool)
        try:
            with engine.connect() as conn:
                versions = conn.execute(
                    text("SELECT version_num FROM optuna.alembic_version")
                ).all()
            assert versions and versions[0][0] != head_revision()
        finally:
            engine.dispose()

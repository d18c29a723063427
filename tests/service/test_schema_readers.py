"""Upgrades without an outage (issue 38 item 2): a replica whose code is one revision behind keeps
serving against a database migrated past it, where the newer revision is expand-only (its
`schema_readers` row still names a revision the older code has); a contracting one says which
code it needs. Here this checkout is the older code: the database is migrated to a revision it
does not have (0011, written into a copy of the migrations), then this code's service serves it."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from alembic import command

from db import current_revision, head_revision, make_engine
from db.database import MIGRATIONS_DIR, alembic_config, migration_connection
from service.testing import DEVICE, WRITE_HEADERS, measurements, problem

NEXT = '''"""the next release: problems get a note (expand-only{contract})

Revision ID: 0011
Revises: {head}
"""
import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "{head}"
branch_labels = None
depends_on = None


def upgrade():
    with op.batch_alter_table("problems") as batch:
        batch.add_column(sa.Column("note", sa.Text(), nullable=True))
    op.execute("UPDATE schema_readers SET min_revision = '{reader}'")


def downgrade():
    with op.batch_alter_table("problems") as batch:
        batch.drop_column("note")
'''


def migrate_past_this_code(db_url: str, tmp_path: Path, reader: str) -> None:
    """Upgrade the database to 0011, a revision this checkout does not have, which names `reader`
    the oldest code that reads it."""
    scripts = tmp_path / "migrations"
    shutil.copytree(MIGRATIONS_DIR, scripts, ignore=shutil.ignore_patterns("__pycache__"))
    contract = "" if reader == head_revision() else "; drops what older code reads"
    (scripts / "versions" / "0011_next.py").write_text(NEXT.format(head=head_revision(), reader=reader,
                                                                   contract=contract))
    engine = make_engine(db_url)
    try:
        with migration_connection(engine) as conn:
            cfg = alembic_config()
            cfg.set_main_option("script_location", str(scripts))
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")
        assert current_revision(engine) == "0011"
    finally:
        engine.dispose()


def test_code_one_revision_behind_serves_an_expand_only_upgrade(make_client: Any, db_url: str,
                                                                tmp_path: Path) -> None:
    migrate_past_this_code(db_url, tmp_path, reader=head_revision())
    client = make_client()
    assert client.get("/healthz").status_code == 200
    r = client.post("/v1/results", headers=WRITE_HEADERS,
                    json={"device": DEVICE, "problem": problem(), "measurements": measurements(1.3)})
    assert r.status_code == 201, r.text                       # it writes too: the new column is nullable
    r = client.post("/v1/lookup", json={"device": DEVICE, "problem": problem()})
    assert r.status_code == 200 and r.json()["source"] == "tuned", r.text
    r = client.post("/v1/lookup/batch", json={"device": DEVICE, "problems": [problem(), problem(m=4096)]})
    assert r.status_code == 200 and [x["source"] for x in r.json()["results"]] == ["tuned", "nearest"]


def test_a_contracting_upgrade_names_the_code_it_needs(make_client: Any, db_url: str, tmp_path: Path) -> None:
    from db import SchemaError

    migrate_past_this_code(db_url, tmp_path, reader="0011")
    with pytest.raises(SchemaError, match=r"is at revision '0011'.*newer \(it needs code at '0011' or later\)"):
        make_client()
